"""Liveness as progress for the processes `pwtrain.launch` starts: each one shows that it runs by
touching a heartbeat file, and the launcher kills one whose file has gone stale.

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
"""

import os
import threading
import time

HEARTBEAT_ENV = "PWTRAIN_HEARTBEAT_FILE"

# A process is stale after this many heartbeat periods without a touch, and never sooner than
# MIN_BOUND_S.
PERIODS = 5
MIN_BOUND_S = 10.0
WEDGED = 3  # a process not stopped is killed after this many bounds without a touch


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


class _Beat:
  """The thread that touches this process's heartbeat file."""

  def __init__(self, path: str, period_s: float):
    self.path, self.period_s = path, period_s
    self.done = threading.Event()
    self.touch()
    self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
    self.thread.start()

  def touch(self) -> None:
    with open(self.path, "a"):
      pass
    os.utime(self.path)

  def _loop(self) -> None:
    while not self.done.wait(self.period_s):
      try:
        self.touch()
      except OSError:  # the launcher's log dir is gone: nobody checks any more
        return

  def stop(self) -> None:
    self.done.set()
    self.thread.join()
    remove(self.path)


_BEAT: list[_Beat] = []


def start(period_s: float) -> None:
  """Touches $PWTRAIN_HEARTBEAT_FILE every `period_s` from a thread, from now until `stop`
  (nothing outside pwtrain.launch, which sets it)."""
  path = os.environ.get(HEARTBEAT_ENV)
  if path and not _BEAT:
    _BEAT.append(_Beat(path, period_s))


def stop() -> None:
  """Stops the heartbeat and removes its file: this process leaves the run (the launcher no
  longer checks it)."""
  while _BEAT:
    _BEAT.pop().stop()
