"""The local launcher: N processes of `pwtrain.main` on this machine, one distributed run.

  python -m pwtrain.launch --nproc=2 -- --config=palm_tiny --workdir=/tmp/run \\
      --config.parallel.islands=2 --config.parallel.pods=2

starts process 0..N-1 of `python -m pwtrain.main <args> --config.backend.mode=distributed`
with a coordinator on loopback (process 0 serves it) and, on CPU, `--devices_per_process`
simulated devices each (default 8 / N, at least 1). Each process's output is kept whole in
<workdir>/launch/process<i>.log (or --log_dir); the console shows process 0's, line by line
prefixed "[p0] ", and of the others only their warnings and errors (one console per run); a
process's crash dump (a fatal runtime error, a C++ stack, a thread dump) goes to its log only,
and the launcher's one line naming the process, how it ended and that log stands for it.

Liveness is progress (pwtrain/liveness.py): each process touches <log dir>/process<i>.alive
every fault.heartbeat_s, and one whose file is older than max(5 x fault.heartbeat_s, 10 s)
while stopped (3 x that when not) makes no progress: the launcher names it, SIGKILLs it, and it
counts as a process that died.

Ctrl-C or SIGTERM to the launcher is passed to every process as SIGTERM (each checkpoints and
exits 0, pwtrain/preemption.py). When a process dies the launcher names it and stops the others
(SIGTERM, then SIGKILL after --grace_s); if the config's `fault.max_restarts` allows, it starts
all of them again, and they resume from the last checkpoint. With `fault.elastic` a process
other than process 0 that dies is named, the others go on without its pod, and it is started
again ($PWTRAIN_REJOIN=1, at most MAX_STARTS times) once process 0 says that they have left it
out (a line of its own, processes.tell_launcher): it rejoins them at a step boundary
(pwtrain/elastic/agreement.py). Process 0 serves the coordination service, and losing it stops
and restarts them all. It exits with the worst status of the last attempt's processes that did
not die and leave the others going (0 when they all succeeded; a process killed by signal s
counts as 128+s).

On a cluster the scheduler starts the processes instead, e.g. under SLURM:
  srun python -m pwtrain.main --config=... --config.backend.mode=distributed
"""

import argparse
import collections
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time

from pwtrain import console, liveness, process_logs
from pwtrain.exits import failed_cause, first_failed, late_rejoins, status
from pwtrain.processes import LAUNCHER_LINE, REJOIN_ENV, describe_exit, free_port

PREFIX = "[launch]"


def parse_args(argv):
  p = argparse.ArgumentParser(
    prog="python -m pwtrain.launch",
    description="Start N processes of pwtrain.main as one distributed run on this machine.",
  )
  p.add_argument("--nproc", type=int, required=True, help="number of processes")
  p.add_argument(
    "--devices_per_process",
    type=int,
    default=0,
    help="simulated CPU devices per process (0: 8 // nproc, at least 1); ignored off CPU",
  )
  p.add_argument("--log_dir", default="", help="default: <workdir>/launch")
  p.add_argument("--grace_s", type=float, default=20.0, help="SIGTERM to SIGKILL when stopping")
  p.add_argument(
    "--max_restarts",
    type=int,
    default=-1,
    help="restarts after a process dies (-1: the config's fault.max_restarts)",
  )
  p.add_argument("main_args", nargs=argparse.REMAINDER, help="-- then pwtrain.main's flags")
  args = p.parse_args(argv)
  if args.main_args and args.main_args[0] == "--":
    args.main_args = args.main_args[1:]
  if args.nproc < 1:
    p.error(f"--nproc={args.nproc} must be >= 1")
  if not any(a.startswith("--config=") or a == "--config" for a in args.main_args):
    p.error("give pwtrain.main's flags after --, at least --config=<file>")
  return args


def _flag(args: list[str], name: str, default: str = "") -> str:
  """The value of `--name=value` (or `--name value`) among pwtrain.main's flags."""
  for i, a in enumerate(args):
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
    if a == f"--{name}" and i + 1 < len(args):
      return args[i + 1]
  return default


def fault(main_args: list[str], key: str):
  """fault.<key> of the config the processes will load, with its command-line override
  (max_restarts: restarts after a process dies; elastic: a dead process's pod is dropped;
  heartbeat_s: how often each touches its heartbeat file, pwtrain/liveness.py)."""
  from pwtrain import config as config_lib

  value = config_lib.load(_flag(main_args, "config", "palm_tiny")).fault[key]
  override = _flag(main_args, f"config.fault.{key}")
  if not override:
    return value
  return override.lower() in ("true", "1") if isinstance(value, bool) else type(value)(override)


def child_env(i: int, n: int, coordinator: str, devices: int) -> dict:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
  env.update(
    PWTRAIN_COORDINATOR=coordinator,
    PWTRAIN_NUM_PROCESSES=str(n),
    PWTRAIN_PROCESS_ID=str(i),
    PWTRAIN_TRANSFER_ADDRESS=f"127.0.0.1:{free_port()}",
    PWTRAIN_LAUNCHER_PID=str(os.getpid()),
    PYTHONUNBUFFERED="1",
  )
  return env


class Attempt:
  """One start of all N processes; echoes and keeps their output."""

  def __init__(self, args, log_dir: str, attempt: int):
    n = args.nproc
    devices = args.devices_per_process or max(1, 8 // n)
    coordinator = f"127.0.0.1:{free_port()}"
    command = [
      sys.executable,
      "-m",
      "pwtrain.main",
      *args.main_args,
      "--config.backend.mode=distributed",
    ]
    mode = "w" if attempt == 0 else "a"
    self.logs = process_logs.ProcessLogs(log_dir, n, mode)  # a refused write: `logs.failed`
    self.beats = [liveness.file_for(log_dir, i) for i in range(n)]
    self._start = lambda i, env: subprocess.Popen(
      command,
      env={**child_env(i, n, coordinator, devices), liveness.HEARTBEAT_ENV: self.beats[i], **env},
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      start_new_session=True,  # our signals reach them only as we forward them
    )
    self.procs = []
    # Processes whose output has begun a crash dump (a fatal runtime error, a C++ stack, a
    # thread dump): from there on their lines go to their logs only (`_on_console`).
    self.dumping: set[int] = set()
    for i in range(n):
      if attempt:
        self.logs.append(i, f"{PREFIX} restart {attempt}\n")
      liveness.remove(self.beats[i])
      self.procs.append(self._start(i, {}))
    self.verbose = any(re.match(r"--?(verbosity|v)(=|$)", a) for a in args.main_args)
    # The processes the run's barriers wait for, as process 0 last said (None: every one).
    self.waited_for: frozenset[int] | None = None
    self._selector = selectors.DefaultSelector()
    for i, proc in enumerate(self.procs):
      self._selector.register(proc.stdout, selectors.EVENT_READ, i)
    self._open_streams = len(self.procs)
    self.echo = threading.Thread(target=self._echo, daemon=True)
    self.echo.start()

  def start_again(self, i: int) -> None:
    """Starts process `i` again in its dead predecessor's place, while the others go on
    (fault.elastic): $PWTRAIN_REJOIN tells it to join them at a step boundary."""
    self.logs.append(i, f"{PREFIX} started again\n")
    liveness.remove(self.beats[i])  # its predecessor's, stale
    self.dumping.discard(i)
    self.procs[i] = self._start(i, {REJOIN_ENV: "1"})
    self._open_streams += 1
    self._selector.register(self.procs[i].stdout, selectors.EVENT_READ, i)

  def _echo(self):
    selector = self._selector
    while self._open_streams:
      for key, _ in selector.select(timeout=0.5):
        line = key.fileobj.readline()
        if not line:
          selector.unregister(key.fileobj)
          self._open_streams -= 1
          continue
        text = line.decode(errors="replace")
        self.logs.append(key.data, text)
        if key.data == 0 and (said := barrier_line(text)) is not None:
          self.waited_for = said  # in process 0's log, not on the console
          continue
        if self._on_console(key.data, text):
          sys.stdout.write(f"[p{key.data}] {text}")
          sys.stdout.flush()

  def left_out(self, i: int) -> bool:
    """Whether process 0 has said that the run's barriers no longer wait for process `i`."""
    return self.waited_for is not None and i not in self.waited_for

  def _on_console(self, process: int, line: str) -> bool:
    """One console: process 0's lines and the others' warnings and errors, without Gloo's
    notices unless pwtrain.main's flags set --verbosity, and without JAX's runtime lines about
    a failure (console.RUNTIME_FAILURE) or crash dumps: a process's lines from the first of a
    dump on (console.DUMP) are in its log only, and the launcher names the process and that
    log in one line when it ends (every line is in the logs)."""
    if process in self.dumping or (console.DUMP.search(line) and not self.verbose):
      self.dumping.add(process)
      return False
    if console.RUNTIME_FAILURE.search(line) and not self.verbose:
      return False
    if process != 0 and _INFO_LINE.match(line):
      return False
    return self.verbose or not console.NOTICE.search(line)  # Gloo's: in the process logs

  def stale(self, bound_s: float) -> list[tuple[int, float]]:
    """(process, seconds silent) of the running processes whose heartbeat file was last
    touched more than `bound_s` ago while the kernel shows them stopped, or more than
    liveness.WEDGED x `bound_s` ago (pwtrain/liveness.py): stopped or wedged."""
    out = []
    for i, proc in enumerate(self.procs):
      silent = liveness.silent_s(self.beats[i])
      if proc.poll() is not None or silent is None or silent <= bound_s:
        continue
      if liveness.stopped(proc.pid) or silent > liveness.WEDGED * bound_s:
        out.append((i, silent))
    return out

  def kill(self, i: int) -> None:
    """SIGKILLs process `i` (its process group), which a stopped process cannot hold off."""
    try:
      os.killpg(self.procs[i].pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    liveness.remove(self.beats[i])

  def signal_all(self, sig) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, sig)
        except ProcessLookupError:
          pass

  def stop(self, grace_s: float) -> None:
    self.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
      time.sleep(0.05)
    self.signal_all(signal.SIGKILL)
    for p in self.procs:
      p.wait()

  def close(self) -> None:
    self.echo.join(timeout=5)
    self.logs.close()


# An absl INFO line ("I1125 21:24:23.123456 ..."): the other processes' go to their logs only.
_INFO_LINE = re.compile(r"^I\d{4} \d\d:\d\d:\d\d")


def barrier_line(line: str) -> frozenset[int] | None:
  """The processes that a line of process 0's output says the run's barriers wait for
  (processes.tell_launcher); None if it is another line."""
  if not line.startswith(LAUNCHER_LINE):
    return None
  return frozenset(int(i) for i in line[len(LAUNCHER_LINE) :].strip().split(",") if i)


# How often a dead process is started again while the others go on (fault.elastic).
MAX_STARTS = 3


def _died(procs, i: int, logs) -> str:
  """What the launcher says of process `i`'s end."""
  code = procs[i].returncode
  return f"process {i} (pid {procs[i].pid}) {describe_exit(code)} (its output: {logs.paths[i]})"


def run(args) -> int:
  log_dir = args.log_dir or os.path.join(_flag(args.main_args, "workdir", "/tmp/pwtrain"), "launch")
  os.makedirs(log_dir, exist_ok=True)
  restarts = args.max_restarts
  if restarts < 0:
    restarts = int(fault(args.main_args, "max_restarts"))
  # fault.elastic: a dead process other than 0 leaves the others going, and is started again
  # once process 0 says they have left it out, at most MAX_STARTS times.
  drops = bool(fault(args.main_args, "elastic"))
  # A process whose heartbeat file is older than this is stopped or wedged: it is killed.
  bound_s = liveness.bound_s(float(fault(args.main_args, "heartbeat_s")))
  stopping = threading.Event()
  current: list[Attempt] = []

  def forward(signum, frame):
    del frame
    stopping.set()
    print(f"{PREFIX} {signal.Signals(signum).name}: asking every process to checkpoint and stop")
    if current:
      current[-1].signal_all(signal.SIGTERM)

  signal.signal(signal.SIGINT, forward)
  signal.signal(signal.SIGTERM, forward)
  attempt = 0
  while True:
    current.append(Attempt(args, log_dir, attempt))
    procs = current[-1].procs
    failed = None
    stop_at = None
    stopped: set[int] = set()  # processes this launcher stopped itself
    left: set[int] = set()  # processes that died while the others went on (fault.elastic)
    again: set[int] = set()  # processes to start again once left out (fault.elastic)
    starts = collections.Counter()
    while any(p.poll() is None for p in procs) or again:
      for i in sorted(again):
        if procs[0].poll() is not None or stopping.is_set():  # the run is over: no rejoin
          again.discard(i)
        elif current[-1].left_out(i):
          again.discard(i)
          print(f"{PREFIX} process {i} started again: it rejoins at a step boundary")
          sys.stdout.flush()
          current[-1].start_again(i)
          left.discard(i)
      if not stopping.is_set():
        for i, silent in current[-1].stale(bound_s):
          print(f"{PREFIX} process {i} (pid {procs[i].pid}) has shown no progress for "
                f"{silent:.1f} s (its heartbeat, pwtrain/liveness.py: bound {bound_s:.0f} s): "
                "stopped or wedged; killing it (SIGKILL)")  # fmt: skip
          sys.stdout.flush()
          current[-1].kill(i)
      if current[-1].logs.failed and not stopping.is_set():  # a full disk: the run stops now
        print(f"{PREFIX} {current[-1].logs.failed}", flush=True)
        stopping.set()  # as a process's death stops it, but with no restart: the disk is full
        current[-1].stop(min(args.grace_s, 5.0))
      if stopping.is_set():  # asked to stop: processes past the grace period are killed
        stop_at = stop_at or time.monotonic() + args.grace_s
        if time.monotonic() > stop_at:
          print(f"{PREFIX} processes still running {args.grace_s:.0f} s after SIGTERM: killed")
          current[-1].signal_all(signal.SIGKILL)
      failed = None if stopping.is_set() else failed_cause(procs, left)  # may look twice
      if failed is not None and not stopping.is_set():
        died = _died(procs, failed, current[-1].logs)
        if drops and failed != 0:
          print(f"{PREFIX} {died}; fault.elastic: the other processes go on without its pod")
          sys.stdout.flush()
          left.add(failed)
          starts[failed] += 1
          if starts[failed] <= MAX_STARTS:
            again.add(failed)
          continue
        why = ": it serves the coordination service, which elastic pods need" if drops else ""
        print(f"{PREFIX} {died}{why}; stopping the other processes")
        sys.stdout.flush()
        stopped = {i for i, p in enumerate(procs) if p.poll() is None}
        current[-1].stop(min(args.grace_s, 5.0))  # the others cannot finish a step now
        break
      time.sleep(0.05)
    for p in procs:
      p.wait()
    current[-1].close()
    codes = [p.returncode for p in procs]
    for i in late_rejoins(codes, left, starts, drops):
      print(f"{PREFIX} process {i}, started again, {describe_exit(codes[i])}: the run finished "
            "before it rejoined")  # fmt: skip
      left.add(i)
    cause = first_failed(codes, left)
    if failed is None and cause is not None and not stopping.is_set():  # all ended between looks
      print(f"{PREFIX} {_died(procs, cause, current[-1].logs)}", flush=True)
    worst = max(status(c) for i, c in enumerate(codes) if i not in left)
    if worst == 0 or stopping.is_set() or attempt >= restarts:
      if worst and not stopping.is_set():
        order = sorted(range(len(codes)), key=lambda i: (i != cause, i))
        ended = [i for i in order if codes[i] and i not in stopped]
        bad = [f"process {i} {describe_exit(codes[i])}" for i in ended]
        if stopped:
          bad.append(f"process(es) {', '.join(map(str, sorted(stopped)))} stopped by the launcher")
        print(f"{PREFIX} giving up after {attempt} restart(s): {'; '.join(bad)}")
      return worst or int(current[-1].logs.failed is not None)
    attempt += 1
    print(f"{PREFIX} restarting all {args.nproc} processes ({attempt} of {restarts})")
    sys.stdout.flush()


def main(argv=None) -> int:
  return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
  sys.exit(main())
