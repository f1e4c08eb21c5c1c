"""Liveness as progress in distributed mode (pwtrain/liveness.py, pwtrain/launch.py): a process
stopped from outside (SIGSTOP) under pwtrain.launch is killed once its heartbeat is older than
the bound, and the run goes on as for a killed one; started by hand, its peers' pulls from it
fail once its beat is older than the bound, and its pod is dropped; a process that dies is one
line on the launcher's console, its dump in its log; a watched process's own bug is not held
back.

Real processes on loopback, real signals from outside the run.
"""

import os
import re
import signal
import subprocess
import threading
import time

import jax
import pytest
import test_elastic_distributed as elastic_distributed
from helpers import SGD, metrics_rows
from signals import child_with_env
from test_distributed import PODS, launch, process_logs, run_main

from pwtrain import console, liveness
from pwtrain.backend.faults import IslandLost, may_be_a_peers_death
from pwtrain.launch import free_port


def test_a_process_beats_until_it_leaves(tmp_path, monkeypatch):
  """The heartbeat thread touches the launcher's file every period; `stop` removes it (a
  process leaving a finished run is no longer checked); no file is no verdict."""
  path = str(tmp_path / "process1.alive")
  monkeypatch.setenv(liveness.HEARTBEAT_ENV, path)
  assert liveness.silent_s(path) is None
  liveness.start(0.05)
  try:
    os.utime(path, (0, 0))  # as if it had been silent since 1970
    assert liveness.silent_s(path) > 1e6
    time.sleep(0.3)
    assert liveness.silent_s(path) < 0.3  # touched again
  finally:
    liveness.stop()
  assert not os.path.exists(path)
  assert liveness.bound_s(2.0) == 10.0 and liveness.bound_s(4.0) == 20.0


def test_the_kernel_tells_a_stopped_process():
  """A process stopped by SIGSTOP is killed at the bound; one merely starved only at WEDGED x
  the bound (liveness.stopped tells them apart)."""
  sleeper = subprocess.Popen(["sleep", "30"])
  try:
    assert not liveness.stopped(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not liveness.stopped(sleeper.pid) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert liveness.stopped(sleeper.pid)
  finally:
    sleeper.kill()
    sleeper.wait()


def test_a_watched_process_waits_only_for_what_a_peers_death_may_cause():
  """A watched distributed process waits for JAX's verdict on a dead peer only when its error
  may be that death (an error of JAX's runtime, an island lost, anywhere in its chain); its own
  bug's traceback is printed at once (main.py)."""

  runtime = jax.errors.JaxRuntimeError("UNAVAILABLE: Error dispatching computation")
  assert may_be_a_peers_death(runtime)
  assert may_be_a_peers_death(IslandLost("island1", "process 1 left the run"))
  try:
    try:
      raise runtime
    except RuntimeError as e:
      raise ValueError("reading the step's metrics failed") from e
  except ValueError as chained:
    assert may_be_a_peers_death(chained)
  for bug in (TypeError("unsupported operand"), KeyError("loss"), AssertionError(), ValueError()):
    assert not may_be_a_peers_death(bug), bug


def test_a_crash_dump_begins_with_one_of_these_lines():
  """The launcher keeps a process's lines off its console from the first line of a dump on."""
  for line in (
    "F1129 00:12:35.952689   11284 client.cc:123] Terminating process because the JAX ...",
    "terminate called after throwing an instance of ''",
    "*** SIGABRT received by PID 12211 (TID 12385) on cpu 1, si_code=-6",
    "Fatal Python error: Aborted",
  ):
    assert console.DUMP.search(line), line
  for line in ("E1129 00:12:35.95 1 coordination_service.cc:9] heartbeat", "Traceback (most"):
    assert not console.DUMP.search(line), line


# 3 pods as 3 processes of 1 device each (test_elastic_distributed.py's), elastic, with a
# heartbeat of 1 s: the launcher's bound is then liveness.MIN_BOUND_S.
ELASTIC_PODS = {
  **elastic_distributed.PODS,
  **elastic_distributed.ELASTIC,
  "train.num_steps": 14,
  "train.checkpoint_every": 100,
  # The live processes wait at step 12 for process 1's replacement, and take it back there.
  "fault.inject": "rejoin:pod1@step12",
}


@pytest.mark.slow
@pytest.mark.processes
def test_a_stopped_process_is_killed_and_the_run_goes_on(tmp_path):
  """Process 1 SIGSTOPped from outside after step 2's row: alive, its sockets open, silent.
  The others find it gone by JAX's missed heartbeats and drop its pod (the drop line gives the
  stall, from the last step to the drop); the launcher finds its heartbeat file older than the
  bound, SIGKILLs it, names it, and starts it again (without the kill it would stay stopped, and
  the run wait at step 12 for its replacement forever), which rejoins at step 12. Every step
  runs once, the run ends 0, and the stall is booked as its own badput."""
  run = launch(tmp_path, 3, ELASTIC_PODS, devices=1, background=True)
  stopped = []
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline and not stopped:
    rows = (
      metrics_rows(tmp_path, running=True) if os.path.exists(tmp_path / "metrics.jsonl") else []
    )
    pid = child_with_env(run.pid, "PWTRAIN_PROCESS_ID", "1")
    if pid and any(row.get("step") == 2 and "loss" in row for row in rows):
      os.kill(pid, signal.SIGSTOP)
      stopped.append((pid, time.monotonic()))
    time.sleep(0.05)
  assert stopped, "step 2's row never came"
  try:
    stdout = run.communicate(timeout=300)[0].decode()
  finally:
    if run.poll() is None:
      run.kill()
    try:
      os.kill(stopped[0][0], signal.SIGKILL)  # never left behind stopped
    except ProcessLookupError:
      pass
  logs = process_logs(tmp_path)
  assert run.returncode == 0, stdout[-3000:] + logs[-3000:]
  pid = stopped[0][0]
  (killed,) = [line for line in stdout.splitlines() if "has shown no progress" in line]
  assert killed.startswith(f"[launch] process 1 (pid {pid}) has shown no progress for "), killed
  silent = float(re.search(r"for ([\d.]+) s", killed)[1])
  assert liveness.MIN_BOUND_S - 0.1 < silent < liveness.MIN_BOUND_S + 10, killed
  assert f"process 1 (pid {pid}) was killed by SIGKILL" in stdout, stdout[-3000:]
  assert "process 1 started again" in stdout, stdout[-3000:]
  rows = metrics_rows(tmp_path)
  steps = [row for row in rows if "loss" in row]
  assert [row["step"] for row in steps] == list(range(1, 15)), [row["step"] for row in steps]
  live = [row["pods_live"] for row in steps]
  assert 2 in live[2:11] and live[11:] == [3, 3, 3], live
  assert "pod 1 rejoined" in stdout, stdout[-3000:]
  (lost,) = [
    line for line in stdout.splitlines() if line.startswith("[p0]") and "pod 1 lost" in line
  ]
  stall = float(re.search(r"stalled ([\d.]+) s from the last step to the drop", lost)[1])
  assert stall > 1.0, lost  # JAX's heartbeat timeout (3 s) less the step in flight, at least
  last = [row for row in rows if "goodput" in row][-1]
  assert last["badput_stall"] > 0, last


@pytest.mark.slow
@pytest.mark.processes
def test_a_dead_process_is_one_line_on_the_launchers_console(tmp_path):
  """Process 0 (the coordination service's) SIGKILLed from outside: process 1's runtime errors
  and its end by JAX from C++ (a fatal line, a C++ stack, Python's thread dump) go to its log;
  the console has one line naming process 0, the signal and its log, and the launcher's verdict."""
  run = launch(tmp_path, 2, {**PODS, "train.num_steps": 400}, background=True)
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:
    pid = child_with_env(run.pid, "PWTRAIN_PROCESS_ID", "0")
    if pid and os.path.isfile(tmp_path / "metrics.jsonl"):
      os.kill(pid, signal.SIGKILL)
      break
    time.sleep(0.05)
  stdout = run.communicate(timeout=120)[0].decode()
  assert run.returncode != 0
  tail = stdout[stdout.index("[launch]") :].splitlines()
  log = tmp_path / "launch" / "process0.log"
  assert tail[0] == (
    f"[launch] process 0 (pid {pid}) was killed by SIGKILL (its output: {log}); stopping the "
    "other processes"
  ), tail
  assert len(tail) == 2 and "giving up after 0 restart(s)" in tail[1], tail
  shown = [line.split("] ", 1)[-1] for line in stdout.splitlines()]
  assert not any(
    console.DUMP.search(line) or console.RUNTIME_FAILURE.search(line) for line in shown
  )
  dumped = open(tmp_path / "launch" / "process1.log").read()
  assert "Terminating process" in dumped or "Fatal" in dumped or "terminate" in dumped, dumped


def test_the_launcher_reads_the_fault_settings_it_needs():
  """max_restarts, elastic and heartbeat_s as the processes will see them."""
  from pwtrain.launch import fault

  args = [f"--config={os.path.join('configs', 'palm_tiny.py')}", "--config.fault.elastic=true"]
  assert fault(args, "elastic") is True and fault(args, "max_restarts") == 0
  assert fault([*args, "--config.fault.heartbeat_s=0.5"], "heartbeat_s") == 0.5


# 2 pods as 2 processes of 1 device each, started by hand (no launcher), elastic, at the default
# heartbeat: JAX's heartbeat timeout is 6 s, the liveness bound 10 s.
BY_HAND = {
  **SGD,
  "parallel.islands": 2,
  "parallel.devices_per_island": 1,
  "parallel.pods": 2,
  "exchange.mode": "sync",
  # Steps of about half a second on 2 loaded cores: a stop lands in one, whose gradients
  # process 0 then waits for by pull (rather than between steps, where JAX's heartbeat timeout
  # ends the agreement's barrier first).
  "train.global_batch": 128,
  "data.streams": 2,
  "train.num_steps": 10,
  "train.log_every": 1,
  "train.checkpoint_every": 100,
  "train.eval_every": 0,
  "fault.elastic": True,
  "fault.heartbeat_s": 2.0,
}


class _ByHand:
  """Two processes of `overrides` started by hand, as a cluster scheduler starts them (the
  coordinator, the process count and the ids in the environment; no launcher, nobody to kill a
  stopped one), with one device each; their stderr lines are kept with their times."""

  def __init__(self, workdir, overrides: dict):
    self.workdir = workdir
    env = {
      "PWTRAIN_COORDINATOR": f"127.0.0.1:{free_port()}",
      "PWTRAIN_NUM_PROCESSES": "2",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    }
    self.procs = [
      run_main(workdir, {**env, "PWTRAIN_PROCESS_ID": str(i)}, overrides, background=True)
      for i in range(2)
    ]
    self.lines = [[], []]  # (time.monotonic(), line) of each process's stderr
    self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in (0, 1)]
    for reader in self.readers:
      reader.start()
    self.stopped: tuple[int, float] | None = None  # (pid, time.monotonic()) of the SIGSTOP

  def _read(self, i: int) -> None:
    for line in self.procs[i].stderr:
      self.lines[i].append((time.monotonic(), line.decode(errors="replace")))

  def text(self, i: int) -> str:
    return "".join(line for _, line in self.lines[i])

  def stop_after(self, step: int) -> None:
    """SIGSTOPs process 1's trainer (the watched child) once step `step`'s row is written."""
    deadline = time.monotonic() + 360
    while self.stopped is None and time.monotonic() < deadline and self.procs[0].poll() is None:
      exists = (self.workdir / "metrics.jsonl").exists()
      rows = metrics_rows(self.workdir, running=True) if exists else []
      pid = child_with_env(self.procs[1].pid, "PWTRAIN_WATCHED", "1")
      if pid and any(row.get("step") == step and "loss" in row for row in rows):
        os.kill(pid, signal.SIGSTOP)
        self.stopped = (pid, time.monotonic())
      time.sleep(0.05)
    assert self.stopped, self.text(0)[-3000:] + self.text(1)[-3000:]

  def seen(self, i: int, text: str, timeout_s: float) -> float | None:
    """Seconds from the SIGSTOP to process `i`'s first line with `text` (None: none came within
    `timeout_s` of the stop, or the process ended without it)."""
    while True:
      ended = self.procs[i].poll() is not None
      if ended:  # its last lines
        self.readers[i].join(timeout=10)
      at = next((t for t, line in self.lines[i] if text in line), None)
      if at is not None or ended or time.monotonic() > self.stopped[1] + timeout_s:
        return None if at is None else at - self.stopped[1]
      time.sleep(0.1)

  def close(self) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()
    if self.stopped:
      try:
        os.kill(self.stopped[0], signal.SIGKILL)  # never left behind stopped
      except ProcessLookupError:
        pass
    for reader in self.readers:
      reader.join(timeout=10)


@pytest.mark.slow
@pytest.mark.processes
def test_a_stopped_process_started_by_hand_is_dropped_within_the_bound(tmp_path):
  """Elastic pods, processes started by hand: process 1's trainer is SIGSTOPped after step 3's
  row. JAX's service takes it for dead after its heartbeat timeout, but process 0 waits on a
  pull from it, whose sockets stay open; its liveness (a count in the key-value store that no
  longer changes) fails that pull once older than the bound, and its pod is dropped: within the
  bound and a margin of the stop, not backend.pull_timeout_s (600 s). Every step runs once and
  process 0 exits 0. SIGCONT once dropped: process 1 finds itself dropped, says so in one line
  and exits 1 (its beat reads the others' verdict, or JAX's service refuses its heartbeat)."""
  run = _ByHand(tmp_path, BY_HAND)
  try:
    run.stop_after(3)
    # Within the bound (10 s), a watchdog tick and a margin for a loaded machine; with no
    # liveness rule process 0 would wait for backend.pull_timeout_s (600 s).
    detected = run.seen(0, "pod 1 lost", 90)
    bound = liveness.bound_s(BY_HAND["fault.heartbeat_s"])
    assert detected is not None, run.text(0)[-3000:]
    assert detected < bound + 20.0, (detected, run.text(0)[-3000:])
    os.kill(run.stopped[0], signal.SIGCONT)  # while process 0 (JAX's service) still runs
    assert run.procs[1].wait(timeout=60) == 1
    assert run.procs[0].wait(timeout=120) == 0, run.text(0)[-3000:]
  finally:
    run.close()
  (drop,) = [line for line in run.text(0).splitlines() if "pod 1 lost" in line]
  print(f"dropped {detected:.1f} s after the SIGSTOP (bound {bound:.0f} s): {drop}")
  steps = [row["step"] for row in metrics_rows(tmp_path) if "loss" in row]
  assert steps == list(range(1, 11)), steps
  woke = run.text(1)
  # Its own beat reads that it was dropped, or JAX's service refuses its heartbeat: one line.
  said = [line for line in woke.splitlines() if "taken for" in line]
  assert len(said) == 1, woke[-3000:]
  assert said[0].endswith(("dropped from the run; it ends", "part of the run; this process stops"))
  assert "Traceback" not in woke, woke[-3000:]


@pytest.mark.slow
@pytest.mark.processes
def test_a_stopped_process_started_by_hand_without_elastic_pods_stops_the_run(tmp_path):
  """Without elastic pods, processes started by hand: process 1's trainer SIGSTOPped after step
  3's row. Process 0 stops with one line naming it and status 1, within JAX's heartbeat timeout
  (3 x fault.heartbeat_s) and a margin, not backend.pull_timeout_s; no traceback. (JAX's
  service finds it first; the pull's liveness rule, at the wider bound, would end process 0
  with a line naming it where JAX does not.)"""
  run = _ByHand(tmp_path, {**BY_HAND, "fault.elastic": False})
  try:
    run.stop_after(3)
    assert run.procs[0].wait(timeout=120) == 1, run.text(0)[-3000:]
    detected = run.seen(0, "error: process 1 of the run is gone", 0)
  finally:
    run.close()
  err = run.text(0)
  print(f"stopped {detected} s after the SIGSTOP")
  assert detected is not None and detected < 3 * BY_HAND["fault.heartbeat_s"] + 20.0, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: process 1 of the run is gone") and "Traceback" not in err, last
