"""Elastic pods in distributed mode (pwtrain/elastic/agreement.py): pods as processes started by
pwtrain.launch on loopback; a SIGKILLed process's pod is dropped and the survivors go on.

The reference is the uninterrupted embedded run of the same model and batch (3 islands of one
device each, as the processes have): the survivors take the lost pod's rows, so the trajectory
equals it within the parity tolerance (the sums over the batch are split differently).
The checkpoints the survivors write are whole, restore in embedded mode, and hold the
uninterrupted run's data positions.
"""

import json
import os

import pytest
from helpers import SGD, assert_close, assert_trees_close, small_config
from test_distributed import final_state, launch, process_logs

from pwtrain import train
from pwtrain.errors import ConfigError

# 3 pods as 3 processes of 1 device each, a data stream each; a short heartbeat (a dead process
# is found after 3 s); checkpoints at steps 4 and 6.
PODS = {
  **SGD,
  "parallel.islands": 3,
  "parallel.devices_per_island": 1,
  "parallel.pods": 3,
  "exchange.mode": "sync",
  "train.global_batch": 6,
  "data.streams": 3,
  "train.num_steps": 6,
  "train.checkpoint_every": 4,
  "train.eval_every": 0,
  "fault.heartbeat_s": 1.0,
}


@pytest.mark.slow
@pytest.mark.processes
def test_a_killed_process_is_dropped_and_the_run_equals_the_uninterrupted_one(tmp_path):
  """Pod 1's process SIGKILLs itself before step 3: the others find it gone, drop its pod and run
  step 3 again with the whole batch; no restart, no checkpoint read, each step once in
  metrics.jsonl, and the losses and parameter norms are the uninterrupted run's. The two
  survivors checkpoint steps 4 and 6 over themselves alone: whole checkpoints, whose final one
  restores in embedded mode to the uninterrupted run's parameters and on a full restart of the
  three processes, each holding that run's data positions (pod 1's stream included: the
  survivors read its rows)."""
  straight = train.run(small_config(**PODS), str(tmp_path / "a"), show_progress=False)
  workdir = tmp_path / "b"
  drill = {"fault.elastic": True, "fault.inject": "kill:pod1@step3"}
  done = launch(workdir, 3, {**PODS, **drill}, devices=1, timeout=240)
  logs = process_logs(workdir)
  assert done.returncode == 0, done.stdout[-3000:] + logs[-3000:]
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  rows = [row for row in rows if "loss" in row]
  assert [row["step"] for row in rows] == list(range(1, 7))
  assert [row["pods_live"] for row in rows] == [3, 3, 2, 2, 2, 2]
  want = [r for r in straight.history if "loss" in r]
  assert_close([row["loss"] for row in rows], [r["loss"] for r in want], "losses")
  assert_close([r["param_norm"] for r in rows], [r["param_norm"] for r in want], "param norms")
  assert "process 1 " in done.stdout and "go on without its pod" in done.stdout
  console = [line for line in done.stdout.splitlines() if line.startswith("[p0]")]
  (lost,) = [line for line in console if "pod 1 lost" in line]
  assert "process 1 left the run" in lost and "at step 3: 2 of 3 pods live" in lost, lost
  assert "s after the fault" in lost, lost
  assert "latest checkpoint: step 6" in done.stdout
  assert "restart" not in done.stdout and "resumed" not in logs
  assert "Fatal" not in logs and "Terminating process" not in logs  # the survivors left cleanly
  for step in (4, 6):  # the data positions the uninterrupted run saved
    assert _data_position(workdir, step) == _data_position(tmp_path / "a", step), step
  restored = final_state(small_config(**PODS), workdir)
  assert restored.start_step == 6
  assert_trees_close(restored.state, straight.state, "final state")
  # A full restart of the three processes restores it like any other (with no step left).
  again = launch(workdir, 3, {**PODS, "fault.elastic": True}, devices=1, timeout=120)
  assert again.returncode == 0, again.stdout[-3000:]
  assert "nothing to train" in again.stdout and "resumed from step 6" in process_logs(workdir)


def _data_position(workdir, step: int) -> dict:
  """The data item of checkpoint `step` in `workdir`, as saved."""
  return json.load(open(os.path.join(workdir, "checkpoints", str(step), "data", "metadata")))


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"parallel.islands": 3}, "each pod must be one process of its own"),
    ({"exchange.mode": "stale"}, "takes exchange.mode='sync'"),
    ({"fault.inject": "kill:pod1@step3,rejoin:pod1@step5"}, "a lost process does not rejoin"),
  ],
)
def test_what_elastic_pods_cannot_do_in_distributed_mode_is_one_clear_error(
  overrides, message, tmp_path
):
  """In this one process every pod's island is on process 0, which the first case refuses; the
  others are refused before that is looked at."""
  config = small_config(
    **{**PODS, "fault.elastic": True, "backend.mode": "distributed", **overrides}
  )
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    train.run(config, str(tmp_path / "run"), show_progress=False)
