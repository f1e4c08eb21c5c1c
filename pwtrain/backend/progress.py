"""Whether this process's execution makes progress: how long the computation of its islands that
has run longest without ending has been running (`longest`), for a process to find itself
wedged (pwtrain/liveness.py: distributed mode's `fault.progress_timeout_s`).

A computation runs from the moment its island's scheduler (backend/scheduler.py) has its inputs
and its executable and launches it, to the moment its outputs are ready. Serialized execution
(CPU): from the launch, once its inputs were awaited and the island held the CPU lock, to its
end on the scheduler's thread. Otherwise (GPU, TPU): from the later of its launch, the end of
the island's computation before it and the arrival of those of its inputs that were not there
at its launch (a pulled one, backend/pulls.py: seen once there, by the next `longest`), to its
outputs' readiness (the island's completion watcher, backend/completion.py).

So what is not execution is never counted: a compile (the dispatch waits for it before the work
is queued), a wait in the queue, for the CPU lock or for an input pulled from a peer (a pull
has a deadline of its own, tied to the peer's liveness: backend/pulls.py), and whatever the
process does outside its islands' queues (a barrier, a save, a host transfer). Transfers
between processes (the cross-process queue, offers, pulls) are waits on a peer, not counted
either. A computation of an island that spans processes waits, inside it, for the other
processes' parts: that wait counts.
"""

import dataclasses
import threading
import time
import weakref


@dataclasses.dataclass(frozen=True)
class Running:
  """The computation of this process that has run longest without ending: `name` (its node's),
  on `island`, for `running_s` seconds."""

  name: str
  island: str
  running_s: float


class IslandRuns:
  """The computations of one island launched and not yet ended, in launch order (one island
  runs them in that order): `launched` as each is launched, `end` once its outputs are ready.

  The first of them runs from the later of its launch and the end of the one before it, and,
  where some of its inputs were not there at its launch (`awaits`), from the moment they are
  seen to be there (by `oldest`, which the beat thread asks every beat): a wait for a pulled
  input is not execution."""

  def __init__(self, island: str):
    self.island = island
    self._launched: dict[int, _Launched] = {}  # key -> its launch, in launch order
    self._last_end = 0.0  # time.monotonic() of the last `end`
    self._lock = threading.Lock()
    with _LOCK:
      _ISLANDS.add(self)

  def launched(self, key: int, name: str, awaits: list = ()) -> None:
    """Computation `key` (node `name`) is launched now; `awaits`: its input arrays whose data
    was not there yet."""
    with self._lock:
      self._launched[key] = _Launched(name, time.monotonic(), list(awaits))

  def end(self, key: int) -> None:
    """Computation `key` has ended (its outputs are ready, or it failed, or never ran)."""
    with self._lock:
      if self._launched.pop(key, None) is not None:
        self._last_end = time.monotonic()

  def oldest(self, now: float) -> Running | None:
    """The computation that runs now, and for how long; None where none does (nothing
    launched, or the first launched still waits for an input)."""
    with self._lock:
      first = next(iter(self._launched.values()), None)
      if first is None:
        return None
      if first.since is None:
        if not all(_there(x) for x in first.awaits):
          return None
        first.since = now if first.awaits else max(first.at, self._last_end)
        first.awaits = []
      return Running(first.name, self.island, now - first.since)


@dataclasses.dataclass
class _Launched:
  name: str
  at: float  # time.monotonic() of its launch
  awaits: list  # its inputs not there at its launch, until they are
  since: float | None = None  # when it began to run, once known


def _there(x) -> bool:
  """Whether array `x`'s data is there (or it is gone: donated to the computation)."""
  try:
    return x.is_deleted() or x.is_ready()
  except Exception:  # noqa: BLE001 - failed: the computation that reads it fails too
    return True


_LOCK = threading.Lock()
_ISLANDS: "weakref.WeakSet[IslandRuns]" = weakref.WeakSet()  # those of schedulers alive
_WATCHED = threading.Event()


def watch():
  """`longest`, after which schedulers made in this process record what runs (`watched`): a
  process that asks `longest` gets it from here, before any island is made (pwtrain/main.py).
  Other processes record nothing: no cost on their launches."""
  _WATCHED.set()
  return longest


def watched() -> bool:
  return _WATCHED.is_set()


def longest() -> Running | None:
  """The computation of this process's islands that has run longest without ending; None where
  none runs."""
  now = time.monotonic()
  with _LOCK:
    islands = list(_ISLANDS)
  running = [r for r in (i.oldest(now) for i in islands) if r is not None]
  return max(running, key=lambda r: r.running_s, default=None)
