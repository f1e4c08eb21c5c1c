"""Elastic pods in distributed mode (pwtrain/elastic/agreement.py): pods as processes started by
pwtrain.launch on loopback; a SIGKILLed process's pod is dropped, the survivors go on, and the
process started again in its place rejoins.

The reference is the uninterrupted embedded run of the same model and batch (3 islands of one
device each, as the processes have): the survivors take the lost pod's rows, so the trajectory
equals it within the parity tolerance (the sums over the batch are split differently).
The checkpoints written while degraded and after the rejoin are whole, restore in embedded mode,
and hold the uninterrupted run's data positions.
"""

import json
import os
import shutil

import pytest
from helpers import SGD, assert_close, assert_trees_close, metrics_rows, small_config
from signals import Kill, Killer, child_with_env, logged_at
from test_distributed import final_state, launch, process_logs

from pwtrain import train
from pwtrain.errors import ConfigError

# 3 pods as 3 processes of 1 device each, a data stream each; checkpoints at steps 4 and 8.
PODS = {
  **SGD,
  "parallel.islands": 3,
  "parallel.devices_per_island": 1,
  "parallel.pods": 3,
  "exchange.mode": "sync",
  "train.global_batch": 6,
  "data.streams": 3,
  "train.num_steps": 8,
  "train.checkpoint_every": 4,
  "train.eval_every": 0,
}
# Islands of 2 devices (a 2-way data mesh), one per process: 12 rows over 3 or fewer pods.
SEVERAL = {"parallel.devices_per_island": 2, "parallel.data": -1, "train.global_batch": 12}
# Elastic pods with a short heartbeat: a dead process is found after 3 s.
ELASTIC = {"fault.elastic": True, "fault.heartbeat_s": 1.0}


@pytest.mark.slow
@pytest.mark.processes
def test_killed_processes_are_dropped_rejoin_and_the_run_equals_the_uninterrupted_one(tmp_path):
  """Pods of 2 devices, each on a process of its own (an island's collectives are Gloo's, within
  its process). Processes SIGKILLed from outside at seeded random times: process 1 during the
  evaluation after step 2, process 2 as the checkpoint of step 4 is being saved. The others find
  each gone, drop its pod (pod 0's process runs its microbatch: nothing compiles) and run what
  failed again (the evaluation, or the step); process 0 saves step 4 alone (no save waits for
  another process); the launcher starts both again, and they rejoin before steps 6 and 7 (their
  state pulled from pod 0's; their Gloo contexts made anew). No restart, each step once in
  metrics.jsonl, and the losses, the evaluations and the parameter norms are the uninterrupted
  run's. Both checkpoints are whole and hold that run's data positions (the lost pods' streams
  included: the survivors read their rows); each restores in embedded mode to that run's state
  at its step, and the one written degraded also on a full restart of the processes."""
  pods = {**PODS, **SEVERAL, "train.eval_every": 2, "train.eval_batches": 10}
  straight = train.run(small_config(**pods), str(tmp_path / "a"), show_progress=False)
  workdir = tmp_path / "b"
  drill = {**ELASTIC, "fault.inject": "rejoin:pod1@step6,rejoin:pod2@step7"}
  run = launch(workdir, 3, {**pods, **drill}, devices=2, background=True)
  process = lambda i: lambda: child_with_env(run.pid, "PWTRAIN_PROCESS_ID", str(i))
  killer = Killer(workdir, [Kill(2, process(1)), Kill(4, process(2))], seed=2)
  stdout = run.communicate(timeout=300)[0].decode()
  killer.join()
  logs = process_logs(workdir)
  assert run.returncode == 0, stdout[-3000:] + logs[-3000:]
  rows = metrics_rows(workdir)
  steps = [row for row in rows if "loss" in row]
  assert [row["step"] for row in steps] == list(range(1, 9))
  live = [row["pods_live"] for row in steps]
  assert live[:3] == [3, 3, 2] and live[4] == 1 and live[6:] == [3, 3], live
  want = [r for r in straight.history if "loss" in r]
  assert_close([row["loss"] for row in steps], [r["loss"] for r in want], "losses")
  assert_close([r["param_norm"] for r in steps], [r["param_norm"] for r in want], "param norms")
  got = [(row["step"], row["eval_loss"]) for row in rows if "eval_loss" in row]
  assert [step for step, _ in got] == [e["step"] for e in straight.evals] == [2, 4, 6, 8]
  assert_close([v for _, v in got], [e["eval_loss"] for e in straight.evals], "evaluations")
  for i in (1, 2):
    assert f"process {i} " in stdout and f"process {i} started again" in stdout
  # Process 0 told the launcher whom the barriers wait for as each drop and rejoin happened
  # (a process is started again only once they no longer wait for it), on its log only.
  told = [line.split()[1] for line in logs.splitlines() if line.startswith("[pwtrain:barriers]")]
  assert told == ["0,2", "0", "0,1", "0,1,2"], told
  assert "[pwtrain:" not in stdout
  console = [line for line in stdout.splitlines() if line.startswith("[p0]")]
  (lost,) = [line for line in console if "pod 1 lost" in line]
  assert "process 1 left the run" in lost, lost
  assert "during the evaluation after step 2: 2 of 3 pods live" in lost, lost
  assert lost.endswith("the evaluation runs again; pod 1's work runs on pod 0"), lost
  (lost,) = [line for line in console if "pod 2 lost" in line]
  assert "process 2 left the run" in lost and "1 of 3 pods live" in lost, lost
  # From the signal to the drop's line. Pod 1's process dies as the survivors wait in the
  # evaluation's agreement: they find it gone by its missing heartbeats, within JAX's heartbeat
  # timeout (3 x 1 s), the coordination service's staleness check (once a second), a heartbeat
  # period and a margin for a loaded machine (the latency itself: bench_elastic). Pod 2's dies
  # while process 0 saves: they find it at the agreement after the save, however long the save
  # took on this machine (its latency: bench_elastic).
  for kill, pod in zip(killer.kills, (1, 2), strict=True):
    (lost,) = [line for line in console if f"pod {pod} lost" in line]
    assert 0 < logged_at(lost) - kill.at < (3 * 1.0 + 1.0 + 1.0 + 10.0 if pod == 1 else 120), lost
  # The failed steps' first run and the drops are badput of steps run again; the steps with
  # pods lost took longer (pod 0's process ran their work too) and the rejoins took time.
  last = [row for row in rows if "goodput" in row][-1]
  assert last["badput_degraded"] > 0, last
  if any(" lost " in line and " at step " in line for line in console):  # else in evaluations
    assert last["badput_rerun"] > 0, last
  (back,) = [line for line in console if "pod 1 rejoined" in line]
  assert "at step 6: 2 of 3 pods live" in back, back
  (back,) = [line for line in console if "pod 2 rejoined" in line]
  assert "at step 7: 3 of 3 pods live" in back, back
  assert "pod 1 rejoined (this process started again) at step 6" in logs
  assert "latest checkpoint: step 8" in stdout
  assert "restart" not in stdout and "resumed" not in logs
  assert "Fatal" not in logs and "Terminating process" not in logs  # every process left cleanly
  for step in (4, 8):  # the data positions the uninterrupted run saved
    assert _data_position(workdir, step) == _data_position(tmp_path / "a", step), step
  restored = final_state(small_config(**pods), workdir)
  assert restored.start_step == 8
  assert_trees_close(restored.state, straight.state, "final state")
  # Step 4, written by process 0 alone, as the latest checkpoint of a 4-step run.
  four = {**pods, "train.num_steps": 4}
  for done in (tmp_path / "a", workdir):
    shutil.rmtree(done / "checkpoints" / "8")
  want = final_state(small_config(**four), tmp_path / "a").state
  restored = final_state(small_config(**four), workdir)
  assert restored.start_step == 4
  assert_trees_close(restored.state, want, "state at step 4")
  again = launch(workdir, 3, {**four, **ELASTIC}, devices=2, timeout=120)
  assert again.returncode == 0, again.stdout[-3000:]
  assert "nothing to train" in again.stdout and "holds step 4" in again.stdout


@pytest.mark.slow
@pytest.mark.processes
def test_the_survivors_own_program_when_lost_pods_are_not_hosted(tmp_path):
  """fault.host_lost_pods=False: after pod 1's process is lost the survivors run a program
  built for two pods, each taking half of pod 1's rows, until it rejoins; the losses are the
  uninterrupted run's."""
  six = {**PODS, "train.num_steps": 6, "train.checkpoint_every": 100}
  straight = train.run(small_config(**six), str(tmp_path / "a"), show_progress=False)
  drill = {"fault.inject": "kill:pod1@step3,rejoin:pod1@step5", "fault.host_lost_pods": False}
  workdir = tmp_path / "b"
  done = launch(workdir, 3, {**six, **ELASTIC, **drill}, devices=1, timeout=240)
  assert done.returncode == 0, done.stdout[-3000:] + process_logs(workdir)[-3000:]
  rows = metrics_rows(workdir)
  rows = [row for row in rows if "loss" in row]
  assert [row["pods_live"] for row in rows] == [3, 3, 2, 2, 3, 3]
  want = [r["loss"] for r in straight.history if "loss" in r]
  assert_close([row["loss"] for row in rows], want, "losses")
  console = [line for line in done.stdout.splitlines() if line.startswith("[p0]")]
  (lost,) = [line for line in console if "pod 1 lost" in line]
  assert "runs on" not in lost, lost


def _data_position(workdir, step: int) -> dict:
  """The data item of checkpoint `step` in `workdir`, as saved."""
  return json.load(open(os.path.join(workdir, "checkpoints", str(step), "data", "metadata")))


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"parallel.islands": 3}, "each pod must be one process of its own"),
    ({"exchange.mode": "stale"}, "takes exchange.mode='sync'"),
    ({"fault.inject": "kill:pod0@step3"}, "pod 0's process serves the coordination service"),
  ],
)
def test_what_elastic_pods_cannot_do_in_distributed_mode_is_one_clear_error(
  overrides, message, tmp_path
):
  """In this one process every pod's island is on process 0, which the first case refuses; the
  others are refused before that is looked at."""
  config = small_config(**{**PODS, **ELASTIC, "backend.mode": "distributed", **overrides})
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    train.run(config, str(tmp_path / "run"), show_progress=False)
