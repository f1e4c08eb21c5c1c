"""Liveness as progress in distributed mode: each process of a run shows that it runs by a beat
from a thread of its own, every `fault.heartbeat_s`; a process whose beat is older than
`bound_s` is taken for stopped or wedged, by the launcher (which kills it) and by its peers
(whose pulls from it fail as from a dead process).

A process that exits is seen at once (its pipe closes). One that is stopped (SIGSTOP, a
debugger, a swapped-out machine) or wedged keeps its sockets open and answers nothing: the
others wait on pulls from it, and the launcher would wait for it forever. So the launcher gives
each process a file, <log dir>/process<i>.alive ($PWTRAIN_HEARTBEAT_FILE); once the process has
joined the run (main.py), a thread of its own sets the file's modification time every
`fault.heartbeat_s`. The launcher checks the files every poll; a file not touched for
`bound_s(heartbeat_s)` (5 periods, at least 10 s) by a process the kernel shows stopped
(SIGSTOP, a debugger), or for WEDGED x that bound by any process (wedged: its heartbeat thread
never gets the GIL), means it makes no progress: the launcher SIGKILLs it and says so in one
line, and the run goes on as for any killed process (fault.elastic: the others drop its pod, and
it is started again; else every process restarts, fault.max_restarts). Its sockets close with
it, so the others' pulls from it fail at once, and they find it gone as they find a killed one.

The bound is wider than JAX's own heartbeat timeout (3 periods), which measures a C++ thread:
the file is touched by a Python thread, which waits for the GIL behind long Python work, and for
the CPU on a loaded machine; a process that is merely starved is given the wider bound. A
process that has not touched its file yet (starting, importing, joining) is not checked:
`backend.connect_timeout_s` bounds its start. A process leaving a finished run removes its file
first (`stop`): its last barriers may wait for slower peers without a beat.

Peers, with or without the launcher: each process also beats in JAX's coordination service's
key-value store (a count under pwtrain/liveness/<i>, set every period), and a pull from another
process (backend/pulls.py) asks `peer_lost` about that process while it waits: a count that has
not changed for `bound_s`, as this process's own clock measures it, means the peer makes no
progress (nothing compares clocks of two hosts). Its pulls then fail as a dead peer's would
(elastic pods drop its pod, fault.elastic) or the waiting process stops with one line naming
it (the run restarts, fault.max_restarts). A peer taken for lost is told so
(`declare_lost`): if it runs again (SIGCONT) its beat thread reads that, says so in one line
and ends the process, as the launcher would have killed it; it never goes on silently beside
the pod set that dropped it. A peer that has not beaten yet, or has left (`stop` deletes its
count), gets no verdict. Where process 0 (the service's) is the one stopped, JAX's own
heartbeat ends the others (pwtrain/watch.py names it).

A beat is not progress by itself: a process whose beat thread runs while its execution is wedged
(one computation of its islands never ends, say a hang in C++ that released the GIL) would beat
forever. So the beat thread also asks, every beat, how long the computation of this process that
has run longest without ending has been running (main.py gives it backend/progress.py's
`longest`: from its launch with its inputs there; compiles, waits for a peer's pull, barriers
and saves are not execution), and once that is longer than `fault.progress_timeout_s` (0:
never) the process says so in one line (`process 1 is wedged: one program has run for S s ...;
it ends`) and ends with status WEDGED_EXIT: from there it is a killed process (its sockets
close, so its peers' pulls and collectives with it fail at once; the launcher starts it again
or stops the run, as for any process that dies; started by hand, its watcher exits with that
status). Bound: within one beat of the timeout.
"""

import logging
import os
import threading
import time

HEARTBEAT_ENV = "PWTRAIN_HEARTBEAT_FILE"

# A process is stale after this many heartbeat periods without a touch, and never sooner than
# MIN_BOUND_S.
PERIODS = 5
MIN_BOUND_S = 10.0
WEDGED = 3  # a process not stopped is killed after this many bounds without a touch
WEDGED_EXIT = 3  # the status of a process that ended itself because its execution is wedged


def bound_s(heartbeat_s: float) -> float:
  """Seconds without a touch after which the launcher takes a process for stopped or wedged."""
  return max(PERIODS * heartbeat_s, MIN_BOUND_S)


def stopped(pid: int) -> bool:
  """Whether the kernel shows process `pid` stopped (by a signal or a tracer); False where it
  cannot tell (not Linux, gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return False
  return state in ("T", "t")


def file_for(log_dir: str, process: int) -> str:
  """The heartbeat file of process `process`, beside its log."""
  return os.path.join(log_dir, f"process{process}.alive")


def silent_s(path: str, now: float | None = None) -> float | None:
  """Seconds since the heartbeat file `path` was last touched; None if there is none (the
  process has not started beating, or has left)."""
  try:
    touched = os.stat(path).st_mtime
  except FileNotFoundError:
    return None
  return (time.time() if now is None else now) - touched


def remove(path: str) -> None:
  """Removes heartbeat file `path`, if there is one: its process is gone or leaving."""
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass


def _client():
  """JAX's distributed client, or None outside a distributed run."""
  from jax._src import distributed

  return distributed.global_state.client


def _key(process: int) -> str:
  return f"pwtrain/liveness/{process}"


def _lost_key(process: int) -> str:
  return f"pwtrain/liveness/lost/{process}"


class _Beat:
  """The thread that beats for this process: touches its heartbeat file (under the launcher)
  and sets its count in the key-value store (distributed mode), every `period_s`, while no
  computation of this process has run longer than `progress_timeout_s` (0: no bound)."""

  def __init__(
    self, path: str | None, client, me: int, period_s: float, progress_timeout_s: float, running
  ):
    self.path, self.client, self.me, self.period_s = path, client, me, period_s
    self.progress_timeout_s, self.running = progress_timeout_s, running
    self.count = 0
    self.done = threading.Event()
    if client is not None:  # a predecessor's verdict is not this process's (a rejoin)
      client.key_value_delete(_lost_key(me))
    self.touch()
    self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
    self.thread.start()

  def touch(self) -> None:
    if self.path:
      with open(self.path, "a"):
        pass
      os.utime(self.path)
    if self.client is not None:
      self.count += 1
      self.client.key_value_set(_key(self.me), str(self.count), allow_overwrite=True)

  def _loop(self) -> None:
    while not self.done.wait(self.period_s):
      self._check_progress()
      try:
        self.touch()
      except OSError:  # the launcher's log dir is gone: nobody checks the file any more
        self.path = None
      except RuntimeError:  # the service is gone: JAX ends this process (pwtrain/watch.py)
        return
      self._check_dropped()

  def _check_progress(self) -> None:
    """Ends this process, in one line, if one of its computations has run longer than
    `progress_timeout_s`: its execution is wedged, whatever its beat says."""
    running = self.running() if self.progress_timeout_s and self.running else None
    if running is None or running.running_s <= self.progress_timeout_s:
      return
    logging.getLogger(__name__).error(
      "process %d is wedged: one program has run for %.1f s (%s, on %s; "
      "fault.progress_timeout_s=%g); it ends",
      self.me,
      running.running_s,
      running.name,
      running.island,
      self.progress_timeout_s,
    )
    logging.shutdown()
    os._exit(WEDGED_EXIT)

  def _check_dropped(self) -> None:
    """Ends this process, in one line, if its peers took it for lost (`declare_lost`)."""
    if self.client is None:
      return
    try:
      said = self.client.key_value_try_get(_lost_key(self.me))
    except RuntimeError:  # not there (NOT_FOUND): still one of the run
      return
    logging.getLogger(__name__).error(
      "process %d was taken for lost by the others (%s) and dropped from the run; it ends",
      self.me,
      said,
    )
    logging.shutdown()
    os._exit(1)

  def stop(self) -> None:
    self.done.set()
    self.thread.join()
    if self.path:
      remove(self.path)
    if self.client is not None:
      try:
        self.client.key_value_delete(_key(self.me))
      except RuntimeError:  # the service is gone: nobody asks any more
        pass


_BEAT: list[_Beat] = []


def start(period_s: float, progress_timeout_s: float = 0.0, running=None) -> None:
  """Beats every `period_s` from a thread, from now until `stop`: touches
  $PWTRAIN_HEARTBEAT_FILE (set by pwtrain.launch) and, in a distributed run, sets this process's
  count in the key-value store; nothing where neither applies. Where it beats, `running()` (the
  backend's progress.longest: the computation that has run longest without ending, with its
  `name`, `island` and `running_s`, or None) running longer than `progress_timeout_s` (0:
  never) ends the process (the module doc)."""
  path, client = os.environ.get(HEARTBEAT_ENV), _client()
  if (path or client is not None) and not _BEAT:
    import jax

    _PERIOD[0] = period_s
    me = jax.process_index()
    _BEAT.append(_Beat(path, client, me, period_s, progress_timeout_s, running))


def stop() -> None:
  """Stops the heartbeat, removes its file and deletes its count: this process leaves the run
  (neither the launcher nor its peers check it any more)."""
  while _BEAT:
    _BEAT.pop().stop()


_PERIOD = [0.0]  # the beat's period, once `start` has run
_SEEN: dict[int, tuple[str, float]] = {}  # peer -> (its count, when this process saw it change)


def peer_lost(process: int) -> str | None:
  """Why peer `process` is taken for stopped or wedged: its count in the key-value store has
  not changed for `bound_s` of this process's clock (measured from the first time it was
  asked here); None while it beats, before it first beats, once it has left, and where this
  process does not beat (not a distributed run)."""
  client = _client()
  if client is None or not _BEAT:
    return None
  try:
    count = client.key_value_try_get(_key(process))
  except RuntimeError:  # NOT_FOUND: not started beating, or left
    _SEEN.pop(process, None)
    return None
  now = time.monotonic()
  seen = _SEEN.get(process)
  if seen is None or seen[0] != count:
    _SEEN[process] = (count, now)
    return None
  silent, bound = now - seen[1], bound_s(_PERIOD[0])
  if silent <= bound:
    return None
  return (
    f"process {process} has not beaten for {silent:.1f} s (pwtrain/liveness.py: bound "
    f"{bound:.0f} s, max(5 x fault.heartbeat_s, {MIN_BOUND_S:.0f} s)): stopped or wedged"
  )


def declare_lost(process: int, why: str) -> None:
  """Tells peer `process` that the others took it for lost (`why`): should it run again, its
  beat thread ends it in one line."""
  client = _client()
  if client is not None:
    client.key_value_set(_lost_key(process), why, allow_overwrite=True)
    _SEEN.pop(process, None)
