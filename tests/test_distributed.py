"""Distributed mode: islands as processes on JAX's own runtime, started by pwtrain.launch.

Every run here is real processes on loopback: `python -m pwtrain.launch --nproc=N` starts N
processes of `pwtrain.main`, each with 2 simulated CPU devices, a coordinator served by process
0 and cross-process transfers over JAX's socket transport. The reference is the embedded run of
the same config in this process (islands of 2 devices each, so every island's mesh is the same),
and the comparison is bitwise: the same programs run on the same values, only the transfers
between islands cross a process boundary.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from helpers import (
  REPO,
  SGD,
  assert_close,
  assert_trees_close,
  metrics_rows,
  small_config,
  step_losses,
)
from signals import Kill, Killer, child_with_env

from pwtrain import train
from pwtrain.launch import free_port

# One data stream per pod: each process reads only its pod's rows (data/loader.py).
PODS = {"parallel.islands": 2, "parallel.pods": 2, "data.streams": 2}
STAGES = {"parallel.islands": 2, "parallel.stages": 2, "train.num_microbatches": 2}
COMMON = {"train.checkpoint_every": 4, "parallel.devices_per_island": 2, "train.eval_every": 6}


def config_of(overrides: dict):
  return small_config(**{**COMMON, **overrides})


def flags_of(overrides: dict) -> list[str]:
  """The config as pwtrain.main flags: helpers' small run plus `overrides`."""
  from helpers import TINY

  base = {
    **TINY,
    "data.max_files": 40,
    "train.log_every": 2,
    "train.num_steps": 12,
    **COMMON,
    **overrides,
  }
  return [f"--config.{k}={v}" for k, v in base.items()]


def launch(
  workdir,
  nproc: int,
  overrides: dict,
  *,
  timeout=300,
  background=False,
  extra=(),
  devices=2,
  env=None,
):
  """`python -m pwtrain.launch` of `nproc` processes (`env`: added to the environment)."""
  env = {**os.environ, **(env or {})}
  command = [
    sys.executable,
    "-m",
    "pwtrain.launch",
    f"--nproc={nproc}",
    f"--devices_per_process={devices}",
    *extra,
    "--",
    f"--config={REPO / 'configs' / 'palm_tiny.py'}",
    f"--workdir={workdir}",
    *flags_of(overrides),
  ]
  if background:
    return subprocess.Popen(
      command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# Every process of a run gets a thread that waits inside JAX's C++ until it exits
# (tests/jax_thread_at_exit/sitecustomize.py): a finished run's processes must still exit 0.
JAX_THREAD_AT_EXIT = {
  "PYTHONPATH": os.pathsep.join(
    [str(REPO / "tests" / "jax_thread_at_exit"), os.environ.get("PYTHONPATH", str(REPO))]
  )
}


def process_logs(workdir) -> str:
  """Every process's whole log (the console shows process 0's lines and the others' warnings)."""
  return "".join(open(path).read() for path in sorted(glob.glob(f"{workdir}/launch/process*.log")))


def assert_same_state(a: dict, b: dict) -> None:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def final_state(config, workdir):
  """The state of `workdir`'s last checkpoint, restored in embedded mode (by a run that has no
  step left to train)."""
  return train.run(config, str(workdir), show_progress=False)


@pytest.fixture(scope="module")
def embedded_pods(tmp_path_factory):
  return train.run(config_of(PODS), str(tmp_path_factory.mktemp("pods")), show_progress=False)


@pytest.mark.slow
@pytest.mark.processes
def test_pods_on_two_processes_equal_embedded(embedded_pods, tmp_path):
  """2 pods (sync exchange) as 2 processes: every logged loss, both evaluations and the final
  parameters and optimizer state equal the embedded run's bitwise; the distributed checkpoint
  restores in embedded mode."""
  result = launch(tmp_path, 2, PODS)
  assert result.returncode == 0, result.stdout[-3000:]
  want = {r["step"]: r["loss"] for r in embedded_pods.history}
  got = step_losses(tmp_path)
  assert sorted(got) == list(range(1, 13))
  assert all(got[s] == want[s] for s in got), (got, want)
  evals = metrics_rows(tmp_path)
  evals = {r["step"]: r["eval_loss"] for r in evals if "eval_loss" in r}
  assert evals == {e["step"]: e["eval_loss"] for e in embedded_pods.evals} and len(evals) == 2
  assert os.path.isdir(tmp_path / "checkpoints" / "12" / "parts")
  restored = final_state(config_of(PODS), tmp_path)
  assert restored.start_step == 12
  assert_same_state(embedded_pods.state, restored.state)
  # One console: process 0's lines; process 1's INFO lines are in its log only.
  log1 = open(tmp_path / "launch" / "process1.log").read()
  assert "process 1 reads data streams [1] of data.streams=2" in log1
  assert "process 0 reads data streams [0] of data.streams=2" in result.stdout
  assert "reads data streams [1]" not in result.stdout
  console = result.stdout.splitlines()
  assert len([line for line in console if "trained steps 1-12 of 12" in line]) == 1
  assert len([line for line in console if ": eval loss" in line]) == 2  # steps 6 and 12
  assert "\r" not in result.stdout
  # Quiet at the default verbosity: no Gloo notice (kept in the process logs), no INFO line of
  # JAX joining the run (libraries are at WARNING from the start), no Orbax notice at each save.
  assert "[Gloo]" in process_logs(tmp_path)
  for noise in ("[Gloo]", "peer ranks", "JAX distributed service", "TypeHandlerRegistry"):
    assert noise not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.processes
def test_pipeline_on_two_processes_equals_embedded(tmp_path):
  """A 2-stage 1F1B pipeline, one stage per process: activations and gradients cross between
  the processes every microbatch. Each process has a thread waiting inside JAX's C++ as it
  exits (JAX_THREAD_AT_EXIT), and each exits 0 (no abort at interpreter finalization)."""
  # Its steps 1-8, all the distributed runs below train.
  embedded = train.run(
    config_of({**STAGES, "train.num_steps": 8}), str(tmp_path / "embedded"), show_progress=False
  )
  overrides = {**STAGES, "train.num_steps": 6, "backend.trace": True}
  result = launch(tmp_path / "dist", 2, overrides, env=JAX_THREAD_AT_EXIT)
  logs = process_logs(tmp_path / "dist")
  assert result.returncode == 0, result.stdout[-3000:] + logs[-3000:]
  assert "Fatal Python error" not in logs and "terminate called" not in logs, logs[-3000:]
  want = {r["step"]: r["loss"] for r in embedded.history}
  got = step_losses(tmp_path / "dist")
  assert got and all(got[s] == want[s] for s in got), (got, want)
  # Every transfer between the stages went by pull (backend/pulls.py): each is offered from the
  # sending stage's queue and pulled by the receiving one (traced from the pull to the data's
  # arrival on "<island>:pulls"); none waited in the ordered queue of device_puts.
  sends = {}
  for path in (tmp_path / "dist" / "trace.json", tmp_path / "dist" / "processes/1/trace.json"):
    events = json.load(open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    queues = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert "cross-process" not in queues.values()
    for e in events:
      if e.get("ph") == "X" and re.fullmatch(r"\d+:(act|grad)\d+\.\d+", e["name"]):
        sends.setdefault(e["name"].split(":")[1][:3], set()).add(queues[e["pid"]])
  assert sends == {"act": {"island0", "island1:pulls"}, "gra": {"island1", "island0:pulls"}}
  # Each process wrote its stage's part of the step-6 checkpoint: it restores in embedded mode.
  config = config_of(STAGES)
  config.train.num_steps = 6
  assert final_state(config, tmp_path / "dist").start_step == 6

  # Damage stage 1's part of step 6, which only process 1 reads: both processes set step 6
  # aside together (none waits for the other's fingerprint) and resume from step 4.
  part = sorted(glob.glob(str(tmp_path / "dist" / "checkpoints" / "6" / "parts" / "*")))[-1]
  files = [f for f in glob.glob(f"{part}/**/d/*", recursive=True) if os.path.isfile(f)]
  biggest = max(files, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 2)
  result = launch(tmp_path / "dist", 2, {**STAGES, "train.num_steps": 8}, timeout=240)
  assert result.returncode == 0, result.stdout[-3000:]
  damaged = [line for line in result.stdout.splitlines() if "checkpoint 6 is damaged" in line]
  assert {line[:4] for line in damaged} == {"[p0]", "[p1]"}, result.stdout[-3000:]
  assert "process 1 could not read it" in next(d for d in damaged if d.startswith("[p0]"))
  assert os.listdir(tmp_path / "dist" / "checkpoints.corrupt") == ["6"]
  assert "resumed from step 4" in result.stdout
  got = step_losses(tmp_path / "dist")
  assert all(got[s] == want[s] for s in range(5, 9)), (got, want)


def _process_pid(launcher: subprocess.Popen, index: int) -> int | None:
  """The pid of the launcher's child with PWTRAIN_PROCESS_ID=index."""
  children = subprocess.run(
    ["ps", "-o", "pid=", "--ppid", str(launcher.pid)], capture_output=True, text=True
  ).stdout.split()
  for pid in children:
    try:
      env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
      continue
    if f"PWTRAIN_PROCESS_ID={index}".encode() in env:
      return int(pid)
  return None


@pytest.mark.slow
@pytest.mark.processes
def test_a_killed_process_restarts_all_and_resumes(embedded_pods, tmp_path):
  """An embedded run's step-4 checkpoint is resumed by 2 processes; process 1 is SIGKILLed after
  the step-8 checkpoint: the launcher names it, stops process 0, starts both again
  (fault.max_restarts=1), they resume from step 8, and the run ends with the uninterrupted
  embedded run's losses and parameters."""
  config = config_of(PODS)
  config.train.num_steps = 4
  train.run(config, str(tmp_path), show_progress=False)
  launcher = launch(tmp_path, 2, {**PODS, "fault.max_restarts": 1}, background=True)
  killed = []

  def kill_after_a_distributed_checkpoint():
    deadline = time.time() + 300
    while time.time() < deadline and not killed:
      pid = _process_pid(launcher, 1)
      if os.path.isdir(tmp_path / "checkpoints" / "8") and pid:
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
      time.sleep(0.05)

  killer = threading.Thread(target=kill_after_a_distributed_checkpoint, daemon=True)
  killer.start()
  out, _ = launcher.communicate(timeout=400)
  killer.join(1)
  text = out.decode(errors="replace")
  assert killed, "process 1 was never killed"
  assert launcher.returncode == 0, text[-3000:]
  assert "resumed from step 4" in text and "resumed from step 8" in text, text[-3000:]
  said = "\n".join(line for line in text.splitlines() if line.startswith("[launch]"))
  assert f"process 1 (pid {killed[0]}) was killed by SIGKILL" in said, said
  assert "restarting all 2 processes (1 of 1)" in said, said
  want = {r["step"]: r["loss"] for r in embedded_pods.history}
  got = step_losses(tmp_path)
  assert sorted(got) == list(range(1, 13)) and all(got[s] == want[s] for s in got if s > 4)
  restored = final_state(config_of(PODS), tmp_path)
  assert restored.start_step == 12
  assert_same_state(embedded_pods.state, restored.state)


@pytest.mark.slow
@pytest.mark.processes
def test_giving_up_names_the_processes_the_launcher_stopped_itself(tmp_path):
  """fault.max_restarts=0: process 1 is killed, the launcher stops process 0 and gives up,
  saying which process died, first, and which it stopped (not both as "killed by SIGKILL");
  process 0 may also have ended on its own as its peer died (status 1), which the line then
  says, after the kill."""
  launcher = launch(tmp_path, 2, {**PODS, "train.num_steps": 400}, background=True)
  deadline = time.time() + 300
  while time.time() < deadline:
    pid = _process_pid(launcher, 1)
    if pid and os.path.isfile(tmp_path / "metrics.jsonl"):
      os.kill(pid, signal.SIGKILL)
      break
    time.sleep(0.05)
  out, _ = launcher.communicate(timeout=120)
  text = out.decode(errors="replace")
  assert launcher.returncode != 0, text[-3000:]
  (line,) = [line for line in text.splitlines() if "giving up" in line]
  cause = "giving up after 0 restart(s): process 1 was killed by SIGKILL; "
  assert line.endswith(cause + "process(es) 0 stopped by the launcher") or line.endswith(
    cause + "process 0 exited with status 1"
  ), line


def test_the_process_a_signal_ended_is_the_cause_named_first():
  """Processes seen ended together: the one a signal ended failed the run (a peer's exit with a
  status follows it), else the lowest; those left out (elastic) and running ones are not."""
  from pwtrain.launch import first_failed

  assert first_failed([1, -9], set()) == 1
  assert first_failed([1, 2], set()) == 0
  assert first_failed([None, 0, -15, -9], set()) == 2
  assert first_failed([1, -9], {1}) == 0
  assert first_failed([None, 0], set()) is None


def test_a_peer_killed_just_after_an_exit_is_named_as_the_cause():
  """The launcher sees process 0 exit with a status while process 1, which a signal ends a
  moment later, still runs (as when a kill's teardown outlasts the peer's broken collective):
  it looks again after exits.CAUSE_S and names process 1."""
  from pwtrain import exits

  exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
  exited.wait()
  running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    threading.Timer(0.1, running.kill).start()
    assert exits.failed_cause([exited, running], set()) == 1
    assert running.returncode == -signal.SIGKILL
  finally:
    running.kill()
    running.wait()


def run_main(workdir, env: dict, overrides: dict, timeout=120, background=False):
  """One pwtrain.main process with the distributed settings in `env`, as a cluster scheduler
  starts it (its Popen, with `background`)."""
  command = [
    sys.executable,
    "-m",
    "pwtrain.main",
    f"--config={REPO / 'configs' / 'palm_tiny.py'}",
    f"--workdir={workdir}",
    "--config.backend.mode=distributed",
    *flags_of(overrides),
  ]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", **env}
  if background:
    return subprocess.Popen(
      command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_process_started_again_after_the_run_finished_is_no_failure():
  """The launcher's verdict with elastic pods: a process started again that could not rejoin
  because process 0 had finished the run does not make a finished run exit non-zero; with
  process 0 failed, or without elastic pods, or a process never started again, it still does."""
  from collections import Counter

  from pwtrain.launch import late_rejoins

  started = Counter({1: 1})
  assert late_rejoins([0, 1, 0], set(), started, drops=True) == [1]
  assert late_rejoins([1, 1, 0], set(), started, drops=True) == []
  assert late_rejoins([0, 1, 0], set(), started, drops=False) == []
  assert late_rejoins([0, 0, 1], set(), started, drops=True) == []
  assert late_rejoins([0, 1, 0], {1}, started, drops=True) == []


def test_the_watch_names_the_dead_process_from_jaxs_fatal_error():
  """pwtrain/watch.py reads which process died from JAX's fatal error, as this JAX writes it:
  the coordination service's tasks that stopped sending heartbeats, or its own process gone; or
  this process itself, refused once it runs again after the others took it for dead."""
  from pwtrain import watch

  peer = (
    "F1127 02:52:55.291 24830 client.cc:87] Terminating process because the JAX distributed "
    "service detected fatal errors. ... absl::Status: UNAVAILABLE: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed. Check the task logs"
  )
  assert watch.gone(peer).startswith("process 1 of the run is gone: it stopped sending")
  service = (
    "F1127 02:54:56.1 1 client.cc:87] Terminating process because the JAX distributed service "
    "detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination "
    "service. Either the leader task was preempted/died/restarted unexpectedly"
  )
  assert watch.gone(service).startswith("process 0 of the run is gone: JAX's coordination")
  # This process, stopped past the heartbeat timeout and running again (SIGCONT).
  woke = (
    "F1129 03:55:47.1 1 client.cc:87] Terminating process because the JAX distributed service "
    "detected fatal errors. absl::Status: ABORTED: Unexpected heartbeat request from an "
    "already-in-error task: 1 with existing error: UNAVAILABLE: Task 1 heartbeat timeout."
  )
  assert watch.gone(woke).startswith("process 1 (this process) was taken for dead by JAX's")
  # Process 0 stopped (SIGSTOP): the calls to its service time out.
  silent = (
    "F1129 04:36:00.1 1 client.cc:87] Terminating process because the JAX distributed service "
    "detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded"
  )
  assert watch.gone(silent).startswith("process 0 of the run is gone or silent (stopped?)")


@pytest.mark.slow
@pytest.mark.processes
def test_a_dead_peer_of_processes_started_by_hand_is_one_line(tmp_path):
  """Two runs of two processes started as a cluster scheduler starts them (the coordinator, the
  process count and the ids in the environment; no launcher), one after the other (side by side,
  four processes on two cores delayed JAX's heartbeat checks past the margin): in one, process 1
  is SIGKILLed from outside at a seeded random time; in the other, process 0, which runs JAX's
  coordination service. Each survivor says so in one pwtrain line naming the dead process and
  exits with status 1, within the heartbeat timeout (3 x fault.heartbeat_s) of the kill and a
  margin for JAX's checks: no traceback, no C++ stack, no dump of threads."""
  run = {**PODS, "train.num_steps": 400, "train.log_every": 1, "fault.heartbeat_s": 1.0}
  for victim in (1, 0):
    workdir, coordinator = tmp_path / f"without{victim}", f"127.0.0.1:{free_port()}"
    env = {"PWTRAIN_COORDINATOR": coordinator, "PWTRAIN_NUM_PROCESSES": "2"}
    procs = [
      run_main(workdir, {**env, "PWTRAIN_PROCESS_ID": str(i)}, run, background=True)
      for i in range(2)
    ]
    trains = lambda parent=procs[victim].pid: child_with_env(parent, "PWTRAIN_WATCHED", "1")
    killer = Killer(workdir, [Kill(3, trains, within=0.5)], seed=victim)
    survivor = procs[1 - victim]
    err = survivor.communicate(timeout=300)[1].decode(errors="replace")
    ended = time.time()
    killer.join()
    procs[victim].wait(timeout=60)
    assert survivor.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: process {victim} of the run is gone"), err[-3000:]
    assert last.endswith("this process stops"), last
    for noise in ("Traceback", "Check failure", "Fatal Python", "Thread 0x", "coordination_"):
      assert noise not in err, err[-3000:]
    # JAX's heartbeat timeout (3 x 1 s), its service's staleness check (once a second), a
    # heartbeat period, and a margin for the exit on a loaded machine (the latency itself:
    # bench_elastic).
    assert ended - killer.kills[0].at < 3 * 1.0 + 1.0 + 1.0 + 10.0, ended - killer.kills[0].at


@pytest.mark.slow
@pytest.mark.processes
def test_bad_distributed_settings_are_one_clear_line(tmp_path):
  """A process id out of range, a coordinator nobody serves in time, and a layout whose islands
  do not match the processes: each one line naming the setting, with nothing written."""
  env = {"PWTRAIN_COORDINATOR": "127.0.0.1:1", "PWTRAIN_NUM_PROCESSES": "2"}
  bad_id = run_main(tmp_path / "a", {**env, "PWTRAIN_PROCESS_ID": "2"}, PODS)
  assert bad_id.returncode != 0
  assert "$PWTRAIN_PROCESS_ID=2 is out of range: process ids are 0..1" in bad_id.stderr
  assert "Traceback" not in bad_id.stderr
  start = time.monotonic()
  lonely = run_main(
    tmp_path / "b",
    {"PWTRAIN_COORDINATOR": "127.0.0.1:9", "PWTRAIN_NUM_PROCESSES": "2", "PWTRAIN_PROCESS_ID": "1"},
    {**PODS, "backend.connect_timeout_s": 3},
  )
  assert lonely.returncode != 0 and time.monotonic() - start < 60
  assert "could not join the run at backend.coordinator='127.0.0.1:9' within 3 s" in lonely.stderr
  assert "Traceback" not in lonely.stderr
  # Two islands of 3 devices on 3 processes of 2: island0 and island1 would share process 1.
  mismatch = launch(tmp_path / "c", 3, {"parallel.islands": 2, "parallel.devices_per_island": 3})
  assert mismatch.returncode != 0
  assert "island0 would span processes [0, 1], which also hold island1" in mismatch.stdout
  for name in ("a", "b"):
    assert not os.path.exists(tmp_path / name / "checkpoints")
  assert not os.path.exists(tmp_path / "c" / "checkpoints" / "4")


@pytest.mark.slow
@pytest.mark.processes
def test_sigterm_to_the_launcher_checkpoints_one_step_and_exits_0(tmp_path):
  """SIGTERM to the launcher reaches every process; they agree on one step, checkpoint it
  together and exit 0, and that checkpoint restores in embedded mode."""
  launcher = launch(tmp_path, 2, {**PODS, "train.num_steps": 400}, background=True)
  deadline = time.time() + 300
  while time.time() < deadline and not os.path.isdir(tmp_path / "checkpoints" / "4"):
    time.sleep(0.05)
  launcher.send_signal(signal.SIGTERM)
  out, _ = launcher.communicate(timeout=120)
  text = out.decode(errors="replace")
  assert launcher.returncode == 0, text[-3000:]
  stopped = re.findall(r"\[p(\d)\].*stop requested: checkpointed step (\d+)", text)
  assert sorted(p for p, _ in stopped) == ["0", "1"], text[-3000:]
  steps = {int(s) for _, s in stopped}
  assert len(steps) == 1, stopped
  step = steps.pop()
  assert 4 < step < 400
  config = config_of(PODS)
  config.train.num_steps = step
  assert final_state(config, tmp_path).start_step == step


@pytest.mark.slow
@pytest.mark.processes
def test_two_pods_of_two_stages_on_four_processes_equal_embedded(tmp_path):
  """2 pods x 2 stages, one island per process: stage transfers within each pod and the
  gradient exchange between the pods' stages all cross processes, and every process also walks
  the transfers between two others. The stages keep their forward's residuals for the
  backward (parallel.stage_remat="none"; the other pipelines here recompute), and the schedule
  is zero_bubble (the last stage's FB keeps its own for its W)."""
  layout = {
    "parallel.islands": 4,
    "parallel.pods": 2,
    "parallel.stages": 2,
    "parallel.stage_remat": "none",
    "parallel.schedule": "zero_bubble",
    "train.num_microbatches": 2,
    "train.num_steps": 4,
    "train.eval_every": 0,
    "data.streams": 2,
  }
  embedded = train.run(config_of(layout), str(tmp_path / "embedded"), show_progress=False)
  result = launch(tmp_path / "dist", 4, layout)
  assert result.returncode == 0, result.stdout[-3000:]
  # Both stages of a pod read its rows (inputs on the first, targets on the last): one stream.
  read = re.findall(
    r"process (\d) reads data streams \[(\d)\] of data.streams=2", process_logs(tmp_path / "dist")
  )
  assert sorted(p for p, _ in read) == ["0", "1", "2", "3"]
  assert sorted(s for _, s in read) == ["0", "0", "1", "1"]
  want = {r["step"]: r["loss"] for r in embedded.history}
  assert step_losses(tmp_path / "dist") == want
  restored = final_state(config_of(layout), tmp_path / "dist")
  assert restored.start_step == 4
  assert_same_state(embedded.state, restored.state)


@pytest.mark.slow
@pytest.mark.processes
def test_one_island_over_two_processes_equals_embedded(tmp_path):
  """One island of 4 devices over 2 processes, its parameters sharded over all 4 (FSDP):
  multi-controller SPMD, each process launching the step on its 2 devices, collectives across
  processes by gloo; each process reads and feeds only the batch rows its devices hold (one of
  2 data streams). Gloo's sums run in another order than one process's: losses and the final
  state (SGD, whose state compares across layouts: helpers.py) equal the embedded run on 4
  devices within the parity tolerance. The checkpoint is Orbax's own multi-process save (each
  process writes its shards), resumes in distributed mode and restores in embedded mode."""
  layout = {
    "parallel.islands": 1,
    "parallel.devices_per_island": 4,
    "parallel.fsdp": 4,
    "parallel.data": 1,
    "train.num_steps": 6,
    "train.eval_every": 0,
    "data.streams": 2,
    **SGD,
  }
  embedded = train.run(config_of(layout), str(tmp_path / "embedded"), show_progress=False)
  first = launch(tmp_path / "dist", 2, {**layout, "train.num_steps": 4})
  assert first.returncode == 0, first.stdout[-3000:]
  assert os.path.isdir(tmp_path / "dist" / "checkpoints" / "4" / "state")  # not parts
  second = launch(tmp_path / "dist", 2, layout)
  assert second.returncode == 0, second.stdout[-3000:]
  assert "resumed from step 4" in second.stdout
  logs = process_logs(tmp_path / "dist")
  for p in (0, 1):  # the batch rows on its 2 devices: one stream's
    assert f"process {p} reads data streams [{p}] of data.streams=2" in logs
  got, want = step_losses(tmp_path / "dist"), {r["step"]: r["loss"] for r in embedded.history}
  assert sorted(got) == sorted(want) == list(range(1, 7))
  assert_close([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], "losses")
  restored = final_state(config_of(layout), tmp_path / "dist")
  assert restored.start_step == 6
  assert_trees_close(jax.device_get(restored.state), jax.device_get(embedded.state), "state")


@pytest.mark.slow
@pytest.mark.processes
def test_pipeline_of_islands_that_span_processes_equals_embedded(tmp_path):
  """A 2-stage pipeline on 4 processes of 1 device: each stage's island spans 2 processes
  (data parallel over them, gloo collectives), and activations and gradients cross between
  islands of different process pairs, both ways: the schedule is interleaved, each island
  holding two of the four one-layer chunks. Each process feeds the batch rows its device holds
  (one of 2 data streams); each island's processes write its checkpoint part together. Equal to
  the embedded run bitwise (gloo's sum of 2 processes' gradients is the same sum as one
  process's of 2 devices); resumes in distributed mode and restores in embedded mode."""
  interleaved = {
    "parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "model.num_layers": 4,
  }  # fmt: skip
  layout = {
    **STAGES, **interleaved, "parallel.data": 2, "data.streams": 2, "train.eval_every": 0, **SGD,
  }  # fmt: skip
  embedded = train.run(
    config_of({**layout, "train.num_steps": 6}), str(tmp_path / "embedded"), show_progress=False
  )
  first = launch(tmp_path / "dist", 4, {**layout, "train.num_steps": 4}, devices=1)
  assert first.returncode == 0, first.stdout[-3000:]
  parts = tmp_path / "dist" / "checkpoints" / "4" / "parts"
  islands = sorted(p.split("-")[0] for p in os.listdir(parts) if os.path.isdir(parts / p))
  assert islands == ["processes0", "processes2"], islands  # one part per island
  second = launch(tmp_path / "dist", 4, {**layout, "train.num_steps": 6}, devices=1)
  assert second.returncode == 0, second.stdout[-3000:]
  assert "resumed from step 4" in second.stdout
  logs = process_logs(tmp_path / "dist")
  for p in range(4):  # process p holds rows of stream p % 2 on either stage
    assert f"process {p} reads data streams [{p % 2}] of data.streams=2" in logs
  got, want = step_losses(tmp_path / "dist"), {r["step"]: r["loss"] for r in embedded.history}
  assert got == want and sorted(got) == list(range(1, 7))
  restored = final_state(config_of({**layout, "train.num_steps": 6}), tmp_path / "dist")
  assert restored.start_step == 6
  assert_same_state(embedded.state, restored.state)


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
  except FileNotFoundError:
    return False


@pytest.mark.slow
@pytest.mark.processes
def test_processes_die_with_a_killed_launcher(tmp_path):
  """A launcher killed outright (SIGKILL: no chance to stop its processes) takes them with it
  within seconds, instead of leaving them to hold the coordinator's port and the cores."""
  launcher = launch(tmp_path, 2, {**PODS, "train.num_steps": 400}, background=True)
  logs = [tmp_path / "launch" / f"process{i}.log" for i in (0, 1)]
  deadline = time.time() + 120
  while time.time() < deadline and not all(
    log.exists() and "reads data streams" in log.read_text() for log in logs
  ):
    time.sleep(0.1)
  pids = [_process_pid(launcher, i) for i in (0, 1)]
  assert all(pids), pids
  launcher.kill()
  launcher.wait()
  deadline = time.time() + 10
  while time.time() < deadline and any(_running(p) for p in pids):
    time.sleep(0.1)
  assert not any(_running(p) for p in pids), pids
