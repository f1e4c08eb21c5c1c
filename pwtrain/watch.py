"""A distributed run's process started by hand or by a cluster scheduler (not by pwtrain.launch):
`pwtrain.main` runs it as a child of its own and watches it, so that a dead peer is one line.

When a process of the run dies, JAX's coordination service finds it by its missed heartbeats
(backend/distributed.py joins with a heartbeat timeout of 3 x fault.heartbeat_s) and tells the
others through its error polling; or, when process 0 dies, the others' calls to the service
fail at once. Either way JAX ends each survivor from C++ (a fatal log: its error, a C++ stack, a
dump of every Python thread), and with this JAX no setting turns that into an error Python could
catch: the client's error callback cannot be given one (its argument does not reach Python), and
`jax_enable_recoverability` keeps a dead process from ending the others but not the loss of the
service's own process. So the process that trains is a child, and this parent, which JAX does
not touch, keeps its console: it passes every line of the child's stderr on (its stdout is the
console's own), except JAX's lines about the failure, reads which process died from them, and
says so in one line, `error: process 1 of the run is gone (...)`, then exits with status 1
(or, where the child itself was stopped past the heartbeat timeout and runs again, that the
service took it for dead).

A child whose step fails with an error that a peer's death may cause (an error of JAX's runtime,
such as a transfer from it: "Error dispatching computation") waits for the service's verdict
(for up to twice the heartbeat timeout, the service's check and a heartbeat period: main.py)
before it reports its own error, so that the line names the peer rather than a traceback; any
other error is its own bug, and its traceback is printed at once. Signals: a
SIGTERM or SIGINT to this parent asks the child to checkpoint and stop (SIGTERM; a terminal's
Ctrl-C also reaches the child itself, as its process group's), and the child dies with it
(distributed.die_with_parent). Exits with the child's status otherwise.
"""

import os
import re
import selectors
import signal
import subprocess
import sys
import time

WATCHED_ENV = "PWTRAIN_WATCHED"  # "1" in the child
PARENT_ENV = "PWTRAIN_WATCHER_PID"  # the parent's pid, for the child's die_with_parent

# An error of JAX's distributed runtime (a C++ log line, in absl's format): a failure begins.
_RUNTIME_ERROR = re.compile(
  r"^[WEF]\d{4} [\d:.]+\s+\d+ (coordination_service\w*|client|distributed\w*|"
  r"preemption\w*)\.cc:\d+\]"
)
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):(.*?)The tasks have", re.S)
_TAKEN = re.compile(r"heartbeat request from an already-in-error task: (\d+)")
_TO_SERVICE = ("Failed to send RPC to coordination service", "leader task")
_HELD_S = 2.0  # how long JAX's lines about a failure are held back, waiting for its verdict


def watched() -> bool:
  """Whether this process is the child a parent watches."""
  return os.environ.get(WATCHED_ENV) == "1"


def run(argv: list[str]) -> int:
  """Runs `python -m pwtrain.main <argv>` as a watched child; its exit status (1 and one line
  when it was ended by JAX because a peer died)."""
  child = subprocess.Popen(
    [sys.executable, "-m", "pwtrain.main", *argv],
    env={**os.environ, WATCHED_ENV: "1", PARENT_ENV: str(os.getpid())},
    stderr=subprocess.PIPE,
  )

  def forward(signum, frame):
    del signum, frame
    if child.poll() is None:
      child.send_signal(signal.SIGTERM)  # a second SIGTERM is still one request to stop

  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
  console = _Console()
  selector = selectors.DefaultSelector()
  selector.register(child.stderr, selectors.EVENT_READ)
  while True:
    if selector.select(timeout=0.5):
      line = child.stderr.readline()
      if not line:
        break
      console.take(line.decode(errors="replace"))
    console.tick()
  code = child.wait()
  if console.fatal is not None:
    print(f"error: {gone(console.fatal)}; this process stops", file=sys.stderr, flush=True)
    return 1
  console.release()
  return 128 - code if code < 0 else code


class _Console:
  """The child's stderr as it reaches the console: from an error of JAX's runtime on, every line
  is held back for a moment (when a peer died, JAX's fatal line follows within milliseconds,
  and the child's own errors about it come in between), and dropped with everything after a
  fatal line, whose text `fatal` keeps."""

  def __init__(self):
    self.held: list[tuple[float, str]] = []
    self.fatal: str | None = None

  def take(self, line: str) -> None:
    if self.fatal is not None:  # its text, then the C++ stack and the threads' dump
      if len(self.fatal) < 4000:
        self.fatal += line
      return
    if _FATAL in line:
      self.fatal, self.held = line, []
      return
    if self.held or _RUNTIME_ERROR.match(line):
      self.held.append((time.monotonic(), line))
      return
    sys.stderr.write(line)
    sys.stderr.flush()

  def tick(self) -> None:
    """Lines held longer than _HELD_S without a fatal one after them go out."""
    if self.held and time.monotonic() - self.held[0][0] > _HELD_S:
      self.release()

  def release(self) -> None:
    for _, line in self.held:
      sys.stderr.write(line)
    self.held = []
    sys.stderr.flush()


def gone(fatal: str) -> str:
  """Which process JAX's fatal error says is gone, in words."""
  unhealthy = _UNHEALTHY.search(fatal)
  if unhealthy:
    ids = sorted({int(i) for i in re.findall(r"(\d+)\s*(?:\n|,|$)", unhealthy.group(1))})
    which = ", ".join(map(str, ids)) or "?"
    return (
      f"process {which} of the run is gone: it stopped sending heartbeats to JAX's "
      "coordination service"
    )
  taken = _TAKEN.search(fatal)
  if taken:  # this process, stopped past the heartbeat timeout, then running again
    return (
      f"process {taken.group(1)} (this process) was taken for dead by JAX's coordination service "
      "(no heartbeat for its timeout: stopped or starved) and is no longer part of the run"
    )
  if any(text in fatal for text in _TO_SERVICE):
    return (
      "process 0 of the run is gone: JAX's coordination service, which it runs, stopped answering"
    )
  status = fatal.split("absl::Status:", 1)[-1].strip().splitlines()
  if status and status[0].startswith("DEADLINE_EXCEEDED"):  # its calls to the service timed out
    return (
      "process 0 of the run is gone or silent (stopped?): JAX's coordination service, which it "
      f"runs, did not answer in time ({status[0]})"
    )
  return f"a process of the run is gone: {status[0] if status else 'JAX ended this process'}"
