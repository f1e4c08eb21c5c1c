"""Starts island workers on this machine (development, tests, benchmarks) and stops them.

    with launcher.launch([4, 4]) as workers:
      cluster = Cluster.connect(workers.addresses, workers.token)

Each worker is a `python -m pwtrain.backend.remote.worker` process on 127.0.0.1 with a free port, a
fresh random token (passed through the environment, never on the command line) and its own
log file.
"""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from pwtrain.backend.remote import auth

_LIVE: "weakref.WeakSet[Workers]" = weakref.WeakSet()


def live() -> list:
  """Worker groups started by this process and not stopped (tests use it to inject faults)."""
  return list(_LIVE)


class Workers:
  def __init__(
    self, sizes, *, token=None, names=None, log_dir=None, start_timeout_s=120.0, env=None
  ):
    """`env`: more environment variables for the workers (e.g. the compilation cache's).
    `log_dir`: where each worker's log goes (<name>.log; a training run's is <workdir>/workers);
    without one, a temporary directory that `stop` removes."""
    self.sizes = list(sizes)
    self.env = dict(env or {})
    self.names = list(names or [f"island{i}" for i in range(len(self.sizes))])
    self.token = token or secrets.token_hex(16)
    self._temporary_logs = log_dir is None
    self.log_dir = log_dir or tempfile.mkdtemp(prefix="pwtrain_workers_")
    os.makedirs(self.log_dir, exist_ok=True)
    self.start_timeout_s = start_timeout_s
    self.procs: list = [None] * len(self.sizes)
    self.ports: list = [0] * len(self.sizes)
    self.lock = threading.RLock()  # held by whoever starts or stops workers (the supervisor)
    _LIVE.add(self)
    try:
      self.start()
    except BaseException:
      self.stop()
      raise

  @property
  def addresses(self) -> list[str]:
    return [f"127.0.0.1:{port}" for port in self.ports]

  def start(self, which=None) -> None:
    """Starts workers `which` (all by default), on their old ports if they had one, so that
    a restarted worker keeps its address; all start in parallel."""
    which = range(len(self.sizes)) if which is None else which
    for i in which:
      env = {**os.environ, **self.env, auth.TOKEN_ENV: self.token}
      log = open(os.path.join(self.log_dir, f"{self.names[i]}.log"), "ab")  # noqa: SIM115
      self.procs[i] = subprocess.Popen(
        [
          sys.executable,
          "-m",
          "pwtrain.backend.remote.worker",
          f"--island={self.names[i]}",
          f"--port={self.ports[i]}",
          f"--devices={self.sizes[i]}",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
      )
      self.procs[i].started_at = time.monotonic()  # kill_at's `started_before`
      log.close()
    for i in which:
      self.ports[i] = self._wait_ready(i)
    _LIVE.add(self)

  def _wait_ready(self, i) -> int:
    proc, line = self.procs[i], []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(self.start_timeout_s)
    text = line[0].decode().strip() if line else ""
    if not text.startswith("READY "):
      self.kill(i)
      log = os.path.join(self.log_dir, f"{self.names[i]}.log")
      with open(log, errors="replace") as f:
        tail = f.read()[-2000:]
      raise RuntimeError(f"worker {self.names[i]} did not start (log {log}):\n{tail}")
    return int(text.split()[1])

  def kill(self, i) -> None:
    """Kills worker i at once (SIGKILL), as a crash would."""
    proc = self.procs[i]
    if proc is not None and proc.poll() is None:
      proc.kill()
      proc.wait()

  def stop(self) -> None:
    _LIVE.discard(self)
    for proc in self.procs:
      if proc is not None and proc.poll() is None:
        proc.terminate()
    for i, proc in enumerate(self.procs):
      if proc is None:
        continue
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.kill(i)
      if proc.stdout and not proc.stdout.closed:
        proc.stdout.close()
    if self._temporary_logs:
      shutil.rmtree(self.log_dir, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def kill_at(address: str, started_before: float = float("inf")) -> bool:
  """SIGKILLs the live worker this process launched at `address`, if it was started before
  `started_before` (time.monotonic(): not one started again in its place since); whether there
  was one."""
  for workers in live():
    for i, (proc, port) in enumerate(zip(workers.procs, workers.ports, strict=True)):
      if f"127.0.0.1:{port}" != address or proc is None or proc.poll() is not None:
        continue
      if getattr(proc, "started_at", started_before) < started_before:
        workers.kill(i)
        return True
  return False


def launch(sizes, **kwargs) -> Workers:
  """Starts one worker per entry of `sizes` (its device count); see Workers."""
  return Workers(sizes, **kwargs)
