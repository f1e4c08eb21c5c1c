"""Where a run's wall time went: goodput and badput by cause, and the memory in use.

Goodput, as MaxText reports it, is the productive step time over the wall time since the run
started. Here the wall time starts when `train.run` is called; the productive time is the time
of the step loop less what the loop spent on anything but steps of the kept trajectory. Badput
is the rest, by cause, each a fraction of the wall time (they and the goodput sum to 1):

  compile     building and compiling the step (Harness.build)
  checkpoint  handing a checkpoint to the writer (save's synchronous part: copies to the host)
  eval        evaluations
  data_wait   waiting for the next batch
  stall       elastic pods: the time between the last progress and a loss being declared: from
              the last step confirmed before the loss (or the first failed step's start, if
              later) to the drop (the failed steps' first run, the wait on the lost peer, the
              detection; elastic/steps.py)
  rerun       steps run again: after a rollback the abandoned steps; after a lost pod the drop
              itself (moving the state, compiling where needed; elastic/steps.py); after a
              restart (a resume, or a start after a lost worker) the steps that an earlier start
              had trained and logged past the checkpoint it resumed from
              (metrics.MetricsLogger: metrics.jsonl says which)
  degraded    elastic pods: the time steps took beyond the clean step time while pods were lost
              (metrics.MetricsLogger, from each interval's productive time per step against that
              of intervals with every pod live), and the rejoins that ended it
  other       everything else: start-up (data preparation, restore), and the end

A run that restarts in the same process (remote mode, after a lost worker) has one Goodput for
all its starts: the time of each start's step loop counts, the time between loops is `other`.
"""

import collections
import contextlib
import resource
import sys
import time

CAUSES = ("compile", "checkpoint", "eval", "data_wait", "stall", "rerun", "degraded", "other")


class Goodput:
  """Accumulates a run's badput by cause; `row()` is its goodput and badput fractions now."""

  def __init__(self, start: float | None = None):
    self.start = time.perf_counter() if start is None else start
    self.loop_start: float | None = None  # when the first start's step loop began
    self.badput: dict[str, float] = collections.defaultdict(float)
    self._looped = 0.0  # seconds in the step loops of earlier starts
    self._loop_began: float | None = None  # when this start's step loop began, while it runs
    self.inside: str | None = None  # the cause of the `bad` block the run is in, if any

  def begin_loop(self, now: float | None = None) -> None:
    """A start's step loop starts: everything before it that was not compiling is `other`."""
    now = time.perf_counter() if now is None else now
    self.loop_start = now if self.loop_start is None else self.loop_start
    self._loop_began = now

  def end_loop(self, now: float | None = None) -> None:
    """A start's step loop has ended (done, or failed): until the next begins is `other`."""
    if self._loop_began is not None:
      self._looped += (time.perf_counter() if now is None else now) - self._loop_began
      self._loop_began = None

  @contextlib.contextmanager
  def bad(self, cause: str):
    """Counts the time inside as badput of `cause`."""
    assert cause in CAUSES, cause
    begin, outer, self.inside = time.perf_counter(), self.inside, cause
    try:
      yield
    finally:
      self.inside = outer
      self.badput[cause] += time.perf_counter() - begin

  def add(self, cause: str, seconds: float) -> None:
    assert cause in CAUSES, cause
    self.badput[cause] += max(seconds, 0.0)

  def productive_s(self, now: float | None = None) -> float:
    """Seconds of the step loops so far less the badput counted inside them."""
    now = time.perf_counter() if now is None else now
    looped = self._looped + (now - self._loop_began if self._loop_began is not None else 0.0)
    inside = sum(v for k, v in self.badput.items() if k not in ("compile", "other"))
    return max(looped - inside, 0.0)

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
