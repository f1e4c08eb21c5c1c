"""Records dispatch, launch and completion of every node, as a Chrome/Perfetto trace.

Three moments per node: `dispatch` (the controller enqueued it), `launch` (its island's
scheduler handed it to the runtime) and `done` (its outputs were ready; recorded by a watcher
thread only while tracing, so normal runs never wait on results). Remote islands report launch
(inputs ready) and done from the worker, collected when the controller closes.

The trace is diagnostics: a write of it that the OS refuses (a full disk, a quota, a file size
limit, an I/O error) is one warning line, no partial file is left, and the run goes on.
"""

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time

from pwtrain.errors import WriteFailed

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Event:
  name: str
  island: str
  step: int
  dispatch: float
  launch: float | None = None
  done: float | None = None


class Trace:
  def __init__(self, record_completion: bool = True):
    self.record_completion = record_completion
    self.events: list[Event] = []
    self._lock = threading.Lock()
    self._t0 = time.perf_counter()
    self._t0_wall = time.time()

  def now(self) -> float:
    return time.perf_counter() - self._t0

  def from_wall(self, t: float) -> float:
    """A Unix time (e.g. a remote worker's, already corrected for its clock) on this trace's
    clock."""
    return t - self._t0_wall

  def add(self, name: str, island: str, step: int) -> Event:
    event = Event(name, island, step, dispatch=self.now())
    with self._lock:
      self.events.append(event)
    return event

  def to_chrome(self) -> dict:
    """Chrome trace format: one process per island; dispatch instants and execute spans."""
    islands = sorted({e.island for e in self.events})
    pid = {name: i for i, name in enumerate(islands)}
    out = [{"ph": "M", "name": "process_name", "pid": pid[n], "args": {"name": n}} for n in islands]
    last_done: dict[str, float] = {}
    with self._lock:
      events = list(self.events)
    for e in events:
      p = pid[e.island]
      args = {"step": e.step}
      out.append(
        {
          "ph": "i",
          "name": f"dispatch {e.name}",
          "pid": p,
          "tid": 0,
          "s": "t",
          "ts": e.dispatch * 1e6,
          "args": args,
        }
      )
      if e.launch is not None and e.done is not None:
        # Each island runs its queue in order, so a node starts when it was launched and its
        # predecessor on the island finished, whichever is later.
        start = max(e.launch, last_done.get(e.island, 0.0))
        out.append(
          {
            "ph": "X",
            "name": e.name,
            "pid": p,
            "tid": 1,
            "ts": start * 1e6,
            "dur": max(e.done - start, 0.0) * 1e6,
            "args": args,
          }
        )
        last_done[e.island] = e.done
    return {"traceEvents": out, "displayTimeUnit": "ms"}

  def write(self, path: str) -> bool:
    """Writes the trace to `path` (`to_chrome`'s JSON); whether it was written. A write the OS
    refuses is one warning line and leaves no file at `path`."""
    try:
      with open(path, "w") as f:
        json.dump(self.to_chrome(), f)
    except OSError as e:
      with contextlib.suppress(OSError):
        os.remove(path)
      log.warning(
        "%s; the run goes on without its trace (backend.trace). Free space on that filesystem, "
        "or set backend.trace=False",
        WriteFailed(path, e),
      )
      return False
    return True
