"""Where a run's wall time went: goodput and badput by cause, and the memory in use.

Goodput, as MaxText reports it, is the productive step time over the wall time since the run
started. Here the wall time starts when `train.run` is called; the productive time is the time
of the step loop less what the loop spent on anything but steps of the kept trajectory. Badput
is the rest, by cause, each a fraction of the wall time (they and the goodput sum to 1):

  compile     building and compiling the step (Harness.build)
  checkpoint  handing a checkpoint to the writer (save's synchronous part: copies to the host)
  eval        evaluations
  data_wait   waiting for the next batch
  rerun       steps run again: after a rollback the abandoned steps, after a lost pod the steps
              that failed with it and the drop itself
  other       everything else: start-up (data preparation, restore), and the end
"""

import collections
import contextlib
import resource
import sys
import time

CAUSES = ("compile", "checkpoint", "eval", "data_wait", "rerun", "other")


class Goodput:
  """Accumulates a run's badput by cause; `row()` is its goodput and badput fractions now."""

  def __init__(self, start: float | None = None):
    self.start = time.perf_counter() if start is None else start
    self.loop_start: float | None = None
    self.badput: dict[str, float] = collections.defaultdict(float)

  def begin_loop(self) -> None:
    """The step loop starts: everything before it that was not compiling is `other`."""
    self.loop_start = time.perf_counter()

  @contextlib.contextmanager
  def bad(self, cause: str):
    """Counts the time inside as badput of `cause`."""
    assert cause in CAUSES, cause
    begin = time.perf_counter()
    try:
      yield
    finally:
      self.badput[cause] += time.perf_counter() - begin

  def add(self, cause: str, seconds: float) -> None:
    assert cause in CAUSES, cause
    self.badput[cause] += max(seconds, 0.0)

  def productive_s(self, now: float | None = None) -> float:
    now = time.perf_counter() if now is None else now
    if self.loop_start is None:
      return 0.0
    inside = sum(v for k, v in self.badput.items() if k not in ("compile", "other"))
    return max(now - self.loop_start - inside, 0.0)

  def row(self, now: float | None = None) -> dict[str, float]:
    """{"goodput", "badput_<cause>"...} as fractions of the wall time since the start."""
    now = time.perf_counter() if now is None else now
    wall = max(now - self.start, 1e-9)
    productive = self.productive_s(now)
    named = {k: self.badput.get(k, 0.0) for k in CAUSES if k != "other"}
    other = max(wall - productive - sum(named.values()), 0.0)
    out = {"goodput": productive / wall}
    out.update({f"badput_{k}": v / wall for k, v in named.items()})
    out["badput_other"] = other / wall
    return out


def memory_row(devices) -> dict[str, int]:
  """Peak device bytes in use, the largest over `devices`, where the runtime reports them
  (`memory_bytes`); else this process's peak resident memory (`host_rss_bytes`)."""
  peaks = []
  for device in devices:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  if peaks:
    return {"memory_bytes": max(peaks)}
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"host_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
