"""Faults as they really come: a SIGKILL (or SIGSTOP: a silent fault) sent from outside a run
(a remote worker, a process of a distributed run) at a seeded random time after a step's metrics
row appears, with no help from the run (not fault.inject).

`Killer` watches a workdir's metrics.jsonl from a thread of the test; each of its kills waits
for its step's row, then a delay drawn from its seed, then sends SIGKILL to whatever process
`pid()` names then, and records when (time.time(), to compare with a log line's time).
"""

import dataclasses
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from helpers import step_losses


@dataclasses.dataclass
class Kill:
  """`sig` (SIGKILL) to `pid()` once step `after`'s metrics row is written, `within` seconds
  later at most (uniformly drawn); `at` (time.time()) and `pid` are filled in when it is sent."""

  after: int
  pid: Callable[[], int | None]
  within: float = 0.05
  sig: int = signal.SIGKILL
  at: float | None = None
  sent_to: int | None = None


class Killer:
  """Sends `kills` in order from a thread, each after its step's row in `workdir`/metrics.jsonl
  (a training row: one with "loss"); `seed` draws the delays. `join` waits for all of them."""

  def __init__(self, workdir, kills: list[Kill], seed: int, timeout_s: float = 300.0):
    self.workdir = workdir
    self.kills, self.timeout_s = kills, timeout_s
    self._rng = random.Random(seed)
    self.error: str | None = None
    self._thread = threading.Thread(target=self._run, name="killer", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    try:
      self._send()
    except Exception as e:  # noqa: BLE001 - the test's join names it
      self.error = f"the killer failed: {e!r}"

  def _send(self) -> None:
    deadline = time.monotonic() + self.timeout_s
    for kill in self.kills:
      delay = self._rng.uniform(0.0, kill.within)
      while kill.after not in self._steps():
        if time.monotonic() > deadline:
          self.error = f"step {kill.after}'s row never came"
          return
        time.sleep(0.002)
      time.sleep(delay)
      pid = kill.pid()
      if pid is None:
        self.error = f"no process to kill after step {kill.after}"
        return
      os.kill(pid, kill.sig)
      kill.at, kill.sent_to = time.time(), pid

  def _steps(self) -> set[int]:
    """The steps of the training rows written whole so far."""
    return set(step_losses(self.workdir, running=True))

  def join(self, timeout: float = 60.0) -> None:
    self._thread.join(timeout)
    assert self.error is None, self.error
    assert all(k.at is not None for k in self.kills), "not every kill was sent"


def child_with_env(parent: int, name: str, value: str) -> int | None:
  """The pid of a child process of `parent` whose environment sets `name`=`value` (a process
  pwtrain.launch started: PWTRAIN_PROCESS_ID), if one runs."""
  children = subprocess.run(
    ["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True
  ).stdout.split()
  for pid in children:
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        environment = f.read().split(b"\0")
    except OSError:  # it has just exited
      continue
    if f"{name}={value}".encode() in environment:
      return int(pid)
  return None


def logged_at(line: str) -> float:
  """The time.time() of an absl log line ("W1127 02:29:54.627454 ..." after any "[p0] "
  prefix), written today (or late yesterday) on this machine."""
  import datetime

  stamp = line.split("] ", 1)[-1] if line.startswith("[p") else line
  month_day, clock = stamp[1:5], stamp.split()[1]
  now = datetime.datetime.now()
  when = datetime.datetime.strptime(f"{now.year}{month_day} {clock}", "%Y%m%d %H:%M:%S.%f")
  return when.timestamp()
