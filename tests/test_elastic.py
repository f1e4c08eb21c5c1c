"""Elastic pods (pwtrain/elastic/): a lost pod is dropped and the run goes on, in process.

Embedded mode with the drill `fault.inject`: the lost pod's islands fail every node from the
given step on, exactly as islands whose devices failed. The survivors' run must equal the
uninterrupted one within the parity tolerance (sync exchange keeps the global batch), each step
appears once in metrics.jsonl, and no checkpoint is read.
"""

import logging
import os
import re
import shutil
import threading
import time

import jax
import numpy as np
import pytest
from helpers import SGD, assert_close, assert_trees_close, metrics_rows, small_config
from signals import Kill, Killer

from pwtrain import harness as harness_lib
from pwtrain import train
from pwtrain.backend.faults import IslandLost
from pwtrain.backend.remote import auth, launcher
from pwtrain.errors import ConfigError
from pwtrain.goodput import Goodput
from pwtrain.metrics import MetricsLogger

# 3 pods of 2 devices (a 2-way data mesh each): 12 rows split over 3 or 2 pods.
THREE_PODS = {
  **SGD,
  "parallel.islands": 3,
  "parallel.devices_per_island": 2,
  "parallel.pods": 3,
  "parallel.data": -1,
  "exchange.mode": "sync",
  "train.global_batch": 12,
  "train.num_steps": 10,
  "train.checkpoint_every": 100,
}
# With evaluations after steps 4, 8 and 10, of 20 batches (long enough to be hit from outside).
EVAL = {"train.eval_every": 4, "train.eval_batches": 20}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  return train.run(small_config(**THREE_PODS, **EVAL), str(workdir), show_progress=False)


def _losses(result):
  return [row["loss"] for row in result.history if "loss" in row]


@pytest.mark.slow
def test_pods_lost_at_any_moment_are_dropped_rejoin_and_the_run_equals_the_uninterrupted_one(
  uninterrupted, tmp_path, caplog
):
  """Losses as they come, each deleting the lost pod's arrays (a real loss's): pods 1 and 2
  while step 2 runs (two at once); pod 1 rejoins at step 4; pod 0, the source of pod 2's state,
  while that state is copied at step 6 (the copy fails, pod 0 is dropped, pod 1 hosts its work
  and reports, and pod 2 copies from pod 1 instead); pod 1 during the evaluation after step 8
  (pod 2 hosts both others and the evaluation runs again); pods 0 and 1 rejoin at step 9. No
  checkpoint is read, no drop compiles, each step appears once, and the losses, evaluations,
  final parameters and every pod's gradient norm are the uninterrupted run's."""
  inject = (
    "kill:pod1@mid2,kill:pod2@mid2,rejoin:pod1@step4,rejoin:pod2@step6,kill:pod0@copy6,"
    "kill:pod1@eval8,rejoin:pod0@step9,rejoin:pod1@step9"
  )
  config = small_config(**THREE_PODS, **EVAL, **{"fault.elastic": True, "fault.inject": inject})
  with caplog.at_level(logging.WARNING, logger="pwtrain"):
    result = train.run(config, str(tmp_path), show_progress=False)
  assert result.final_step == 10
  _assert_the_uninterrupted_run(result, uninterrupted, tmp_path)
  live = _pods_live(tmp_path)  # the loss while step 2 runs may fail step 1, still in flight
  assert live[2:5] == [1, 2, 2] and live[5:8] == [2, 2, 2] and live[8:] == [3, 3], live
  lost = [r.getMessage() for r in caplog.records if " lost " in r.getMessage()]
  assert len(lost) == 3 and all("(compile 0.00 s," in line for line in lost), lost
  assert lost[0].startswith(
    "pod 1,2 lost (fault.inject kill:pod1@mid2; fault.inject kill:pod2@mid2) at step "
  ), lost[0]  # both named
  assert "1 of 3 pods live" in lost[0] and "-2 run again" in lost[0], lost[0]
  assert lost[0].endswith("pod 1's work runs on pod 0; pod 2's work runs on pod 0"), lost[0]
  assert lost[1].startswith(
    "pod 0 lost (fault.inject kill:pod0@copy6) during pod 2's rejoin after step 5: 1 of 3 pods"
  ), lost[1]
  assert lost[1].endswith("pod 0's work runs on pod 1; pod 2's work runs on pod 1"), lost[1]
  assert lost[2].startswith(
    "pod 1 lost (fault.inject kill:pod1@eval8) during the evaluation after step 8: 1 of 3 pods"
  ), lost[2]
  rejoined = [r.getMessage() for r in caplog.records if " rejoined " in r.getMessage()]
  assert [line.split(" (")[0] for line in rejoined] == [
    "pod 1 rejoined", "pod 2 rejoined", "pod 0,1 rejoined"
  ], rejoined  # fmt: skip
  assert "at step 6: 2 of 3 pods live" in rejoined[1], rejoined[1]  # pods 1 and 2
  assert "resumed" not in caplog.text  # no checkpoint read
  # The failed steps' first run and the drops are badput of steps run again.
  last = [row for row in metrics_rows(tmp_path) if "goodput" in row][-1]
  assert last["badput_rerun"] > 0 and last["badput_degraded"] > 0, last  # and the rejoins


@pytest.mark.slow
def test_a_lost_pods_microbatches_are_shared_out_over_the_survivors(tmp_path, caplog):
  """With 2 microbatches a pod, lost pod 1's first runs on pod 0 and its second on pod 2, its
  running gradient sums moving from one to the other: the run is the uninterrupted one."""
  shared = {**THREE_PODS, "parallel.devices_per_island": 1, "train.num_microbatches": 2}
  shared["train.num_steps"] = 6
  straight = train.run(small_config(**shared), str(tmp_path / "a"), show_progress=False)
  drills = {"fault.elastic": True, "fault.inject": "kill:pod1@step3,rejoin:pod1@step5"}
  with caplog.at_level(logging.WARNING, logger="pwtrain"):
    result = train.run(small_config(**shared, **drills), str(tmp_path / "b"), show_progress=False)
  (line,) = [r.getMessage() for r in caplog.records if " lost " in r.getMessage()]
  assert line.endswith("pod 1's work runs on pods 0,2"), line
  assert _pods_live(tmp_path / "b") == [3, 3, 2, 2, 3, 3]
  assert_close(_losses(result), _losses(straight), "losses")
  assert_trees_close(result.state["params"], straight.state["params"], "params")


def _pods_live(workdir) -> list[int]:
  return [row["pods_live"] for row in metrics_rows(workdir) if "loss" in row]


def _assert_the_uninterrupted_run(result, uninterrupted, workdir) -> None:
  """Each step once in metrics.jsonl; its losses, evaluations, final parameters and each pod's
  gradient norm (a hosted pod's too) equal the uninterrupted run's."""
  assert_close(_losses(result), _losses(uninterrupted), "losses")
  assert [e["step"] for e in result.evals] == [e["step"] for e in uninterrupted.evals]
  evals = [[e["eval_loss"] for e in r.evals] for r in (result, uninterrupted)]
  assert_close(*evals, "evaluations")
  assert_trees_close(result.state["params"], uninterrupted.state["params"], "params")
  rows = [row for row in metrics_rows(workdir) if "loss" in row]
  assert [row["step"] for row in rows] == list(range(1, len(_losses(uninterrupted)) + 1))
  want = {row["step"]: row for row in uninterrupted.history}
  norms = [f"pod{q}_grad_norm" for q in range(THREE_PODS["parallel.pods"])]
  for row in rows:
    if norms[0] in want[row["step"]]:
      assert_close([row[k] for k in norms], [want[row["step"]][k] for k in norms], "grad norms")


@pytest.mark.slow
def test_checkpoints_written_while_degraded_are_whole_and_resume(uninterrupted, tmp_path, caplog):
  """Pod 0 (whose arrays the checkpoints take, and which reports the metrics) is lost right
  after an asynchronous save of step 3: pod 1 hosts its work and reports, nothing compiles, and
  step 6 is saved from pod 1's state: both commit whole, and a run resumed from step 6 by the
  plain three-pod config continues the uninterrupted trajectory."""
  workdir = tmp_path / "run"
  drills = {"fault.elastic": True, "fault.inject": "kill:pod0@step4,rejoin:pod0@step8"}
  config = small_config(
    **{**THREE_PODS, **drills, "train.checkpoint_every": 3, "train.keep_checkpoints": 5}
  )
  with caplog.at_level(logging.WARNING, logger="pwtrain"):
    result = train.run(config, str(workdir), show_progress=False)
  assert_close(_losses(result), _losses(uninterrupted), "losses")
  (line,) = [r.getMessage() for r in caplog.records if " lost " in r.getMessage()]
  assert "(compile 0.00 s," in line and line.endswith("pod 0's work runs on pod 1"), line
  checkpoints = workdir / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [3, 6, 9, 10]
  for later in ("9", "10"):
    shutil.rmtree(checkpoints / later)
  resumed = train.run(small_config(**THREE_PODS), str(workdir), show_progress=False)
  assert resumed.start_step == 6
  assert_close(_losses(resumed), _losses(uninterrupted)[6:], "losses after resuming")
  assert_trees_close(resumed.state["params"], uninterrupted.state["params"], "params")


@pytest.mark.slow
def test_diloco_averages_only_the_live_pods_deltas(tmp_path):
  """DiLoCo with one inner step, outer lr 1 and no momentum averages the pods' SGD steps: after
  pod 2 is lost between outer steps, the two survivors' average over their six rows each is the
  three pods' average over four, so the run equals the uninterrupted one."""
  diloco = {
    **THREE_PODS, "optim.b1": 0.0, "optim.clip_norm": 1e9, "exchange.mode": "diloco",
    "exchange.inner_steps": 1, "exchange.outer_lr": 1.0, "exchange.outer_momentum": 0.0,
    "train.num_steps": 6,
  }  # fmt: skip
  straight = train.run(small_config(**diloco), str(tmp_path / "a"), show_progress=False)
  drills = {"fault.elastic": True, "fault.inject": "kill:pod2@step3"}
  elastic = train.run(small_config(**diloco, **drills), str(tmp_path / "b"), show_progress=False)
  assert_close(_losses(elastic), _losses(straight), "losses")
  survivors = elastic.state["pods"]
  assert len(survivors) == 2 and len(straight.state["pods"]) == 3
  assert_trees_close(survivors[0]["params"], straight.state["pods"][0]["params"], "params")
  jax.tree.map(np.testing.assert_array_equal, survivors[0]["params"], survivors[1]["params"])


@pytest.mark.slow
def test_two_pods_of_two_stages_lose_and_regain_a_pod(tmp_path):
  """The pipeline layout, interleaved (two chunks an island), exchange overlapped (each chunk's
  gradients sent as its backward ends: a pod's cells are its chunks): pod 1's two islands are
  lost, pod 0's run its microbatches after their own with the whole batch, and pod 1 rejoins;
  the run equals the uninterrupted one."""
  pipeline = {
    **SGD, "parallel.islands": 4, "parallel.devices_per_island": 2, "parallel.pods": 2,
    "parallel.stages": 2, "parallel.data": -1, "train.num_microbatches": 2,
    "train.global_batch": 16, "train.num_steps": 8, "model.num_layers": 4,
    "exchange.mode": "overlapped", "parallel.schedule": "interleaved",
    "parallel.virtual_stages": 2,
  }  # fmt: skip
  straight = train.run(small_config(**pipeline), str(tmp_path / "a"), show_progress=False)
  drills = {"fault.elastic": True, "fault.inject": "kill:pod1@step3,rejoin:pod1@step6"}
  elastic = train.run(small_config(**pipeline, **drills), str(tmp_path / "b"), show_progress=False)
  assert_close(_losses(elastic), _losses(straight), "losses")
  assert_trees_close(elastic.state["params"], straight.state["params"], "params")
  live = [row["pods_live"] for row in metrics_rows(tmp_path / "b") if "loss" in row]
  assert live == [2, 2, 1, 1, 1, 2, 2, 2]


@pytest.mark.slow
def test_the_stale_exchange_carries_on_without_a_pod(tmp_path):
  """stale (the in-flight gradient, summed over every pod before the loss, is applied; then the
  survivors' over the whole batch) loses pod 2 and equals its uninterrupted run, with the
  survivors' program built for two pods (fault.host_lost_pods=False; hosted: sync and
  overlapped above)."""
  exchange = {**THREE_PODS, "exchange.mode": "stale", "train.num_steps": 6}
  straight = train.run(small_config(**exchange), str(tmp_path / "a"), show_progress=False)
  drills = {"fault.elastic": True, "fault.inject": "kill:pod2@step3", "fault.host_lost_pods": False}
  elastic = train.run(small_config(**exchange, **drills), str(tmp_path / "b"), show_progress=False)
  assert_close(_losses(elastic), _losses(straight), "losses")
  assert_trees_close(elastic.state["params"], straight.state["params"], "params")


@pytest.mark.slow
def test_the_batch_may_shrink_instead(tmp_path):
  config = small_config(
    **THREE_PODS,
    **{"fault.elastic": True, "fault.inject": "kill:pod2@step2", "fault.keep_global_batch": False},
  )
  result = train.run(config, str(tmp_path), show_progress=False)
  assert result.final_step == 10 and all(np.isfinite(_losses(result)))


def test_below_min_pods_the_loss_stops_the_run_with_one_line(tmp_path, caplog):
  config = small_config(
    **THREE_PODS, **{"fault.elastic": True, "fault.inject": "kill:pod1@step3", "fault.min_pods": 3}
  )
  with caplog.at_level(logging.ERROR, logger="pwtrain"), pytest.raises(RuntimeError, match="lost"):
    train.run(config, str(tmp_path), show_progress=False)
  (line,) = [r.getMessage() for r in caplog.records if "fault.min_pods" in r.getMessage()]
  assert "pod 1 lost" in line and "2 of 3 pods left" in line


def test_steps_slower_while_pods_are_lost_are_degraded_badput(tmp_path):
  """Each log interval's productive time per step against that of the intervals with every pod
  live (the first, warming up, left out): steps with pods lost that take longer are badput,
  `degraded`, by what they take beyond it; as fast, nothing."""
  goodput = Goodput(start=0.0)
  goodput.begin_loop(now=0.0)
  logger = MetricsLogger(
    str(tmp_path), start_step=0, num_steps=8, log_every=2, tokens_per_step=1, flops_per_token=1,
    num_devices=1, peak_flops_per_device=None, progress="none", goodput=goodput,
  )  # fmt: skip

  def interval(first, live, now):
    logger._count_badput([{"step": first + i, "pods_live": n} for i, n in enumerate(live)], now)

  interval(1, [3, 3], now=4.0)  # warming up: 2 s a step, not the clean step time
  interval(3, [3, 3], now=6.0)  # every pod live: 1 s a step
  interval(5, [2, 2], now=9.0)  # pods lost: 1.5 s a step, 0.5 s beyond the clean step time each
  assert goodput.badput["degraded"] == 1.0
  interval(7, [2, 3], now=11.0)  # 1 s a step: nothing more
  assert goodput.badput["degraded"] == 1.0
  logger.close()


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["returns", "refuses"])
def test_a_drop_found_while_its_step_was_dispatched_stalls_from_the_dispatchs_start(
  dispatch, tmp_path, caplog, monkeypatch
):
  """Step 3's dispatch waits 1 s (as a remote dispatch waits on a silent worker until it is
  lost: here a delay before the real Harness.step), and pod 1 is lost: `returns`, while the
  step runs (the drill `kill:pod1@mid3`); `refuses`, at the end of the wait, and the dispatch
  fails with IslandLost (as a remote dispatch to a lost worker does). Either way the drop
  line's stall counts from when that dispatch began (the steps before it confirmed first,
  `backend.max_inflight_steps=0`), so it holds the wait, not 0."""
  real, waited = harness_lib.Harness.step, []

  def waits(self, state, batch, step, **kwargs):
    if step == 2 and not waited:  # its first run only, not its run again after the drop
      waited.append(step)
      time.sleep(1.0)
      if dispatch == "refuses":
        island = self.plan.islands[1].name
        self.controller.lose(island, "silent")
        raise IslandLost(island, "silent")
    return real(self, state, batch, step, **kwargs)

  monkeypatch.setattr(harness_lib.Harness, "step", waits)
  inject = "kill:pod1@mid3" if dispatch == "returns" else ""
  config = small_config(
    **{**THREE_PODS, "train.num_steps": 4, "backend.max_inflight_steps": 0},
    **{"fault.elastic": True, "fault.inject": inject},
  )
  with caplog.at_level(logging.WARNING, logger="pwtrain"):
    result = train.run(config, str(tmp_path), show_progress=False)
  assert result.final_step == 4 and waited == [2]
  (stall,) = [
    float(m.group(1))
    for r in caplog.records
    if (m := re.search(r"stalled ([0-9.]+) s from the last step", r.getMessage()))
  ]
  assert stall >= 1.0, stall


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"fault.inject": "kill:pod1@step4"}, "has no effect: it is read only with fault.elastic"),
    ({"fault.elastic": True, "fault.inject": "kill:pod7@step4"}, "a pod below parallel.pods=3"),
    ({"fault.elastic": True, "fault.inject": "explode"}, "is not 'kill:pod<P>@<place><N>'"),
    ({"fault.elastic": True, "train.global_batch": 6}, "with 2 live pods"),
  ],
)
def test_bad_fault_settings_are_one_clear_error(overrides, message, tmp_path):
  config = small_config(**{**THREE_PODS, **overrides})
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    train.run(config, str(tmp_path / "run"), show_progress=False)
  assert not (tmp_path / "run").exists()


def test_a_computation_that_finds_its_devices_gone_loses_its_island():
  """A device-loss error (a status code of devices gone, as a slice down under Pathways reports
  it) marks the island lost: that node and every later one fail with IslandLost. Any other
  error of a computation stays the program's."""
  import concurrent.futures

  from pwtrain.backend.faults import IslandLost
  from pwtrain.backend.scheduler import IslandScheduler, Work

  def gone():
    raise jax.errors.JaxRuntimeError("UNAVAILABLE: the slice of these devices is down")

  def oom():
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

  scheduler = IslandScheduler("island1", None, None)
  try:
    outs = [concurrent.futures.Future() for _ in range(3)]
    for out, launch in zip(outs, (oom, gone, lambda: 1), strict=True):
      scheduler.queue.put(Work("node", launch, [], out))
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
      outs[0].result(timeout=30)
    for out in outs[1:]:
      with pytest.raises(IslandLost, match="island island1 lost: UNAVAILABLE"):
        out.result(timeout=30)
  finally:
    scheduler.stop()


# -- remote mode: worker processes on loopback, SIGKILLed by the drill --------------------------


def _remote(**overrides):
  remote = {"backend.mode": "remote", "fault.elastic": True, "fault.heartbeat_s": 0.5}
  return small_config(**{**THREE_PODS, **remote, **overrides})


@pytest.mark.slow
@pytest.mark.processes
def test_remote_pod_killed_carries_on_is_relaunched_and_rejoins(uninterrupted, tmp_path, caplog):
  """3 pods as 3 worker processes the run launches: pod 1's worker is SIGKILLed from outside
  during the evaluation after step 4 (at a seeded random time). The survivors drop it and run
  the evaluation again, without a restart; the supervisor relaunches the worker, and pod 1
  rejoins at step 6, as the drill says (not earlier, however soon it answers; the drill waits
  for it there), given its executables again and pod 0's state worker to worker. The run and
  its evaluations are the uninterrupted embedded one's."""
  config = _remote(**EVAL, **{"backend.launch_workers": True, "fault.inject": "rejoin:pod1@step6"})
  killer = Killer(tmp_path, [Kill(after=4, pid=lambda: _worker(1).pid)], seed=4)
  with caplog.at_level(logging.INFO, logger="pwtrain"):
    result = train.run(config, str(tmp_path), show_progress=False)
  killer.join()
  assert result.final_step == 10
  _assert_the_uninterrupted_run(result, uninterrupted, tmp_path)
  live = _pods_live(tmp_path)
  assert live[:4] == [3] * 4 and live[4] == 2 and live[5:] == [3] * 5, live
  messages = [r.getMessage() for r in caplog.records]
  (lost,) = [r for r in caplog.records if r.getMessage().startswith("pod 1 lost")]
  detection_s = lost.created - killer.kills[0].at  # from the signal to the drop's line
  # A dead worker's stream fails at once; the drop's line follows once the survivors' work is
  # settled (the latency itself: bench_elastic).
  assert 0 < detection_s < 3 * 0.5 + 5.0, detection_s
  lost = lost.getMessage()
  assert "during the evaluation after step 4: 2 of 3 pods live" in lost, lost
  assert lost.endswith("the evaluation runs again; pod 1's work runs on pod 0"), lost
  assert any(
    re.match(r"worker island1 \(pid \d+\) was killed by SIGKILL; relaunched", m) for m in messages
  )
  assert any(m.startswith("pod 1 rejoined") for m in messages)
  assert not any("restart" in m or "resumed" in m for m in messages)


def _worker(i: int):
  """The process of worker i of the workers this process launched (the run's)."""
  (workers,) = launcher.live()
  return workers.procs[i]


@pytest.mark.slow
@pytest.mark.processes
def test_remote_two_pods_lose_one_during_a_save_and_get_it_back(tmp_path, caplog, capfd):
  """2 pods on workers started outside the run: pod 0's worker, which holds the checkpoints'
  arrays, is SIGKILLed from outside (at a seeded random time) as its asynchronous save of step
  3 is queued or being written; pod 1 runs on alone, hosting pod 0's work (nothing compiles)
  and reporting the metrics, and saves step 6 by itself; someone starts the worker again and
  pod 0 rejoins at step 8. Every checkpoint that committed is whole: the step-3 save committed
  or was discarded (one line, and no Orbax warning), and a plain embedded run resumed from step
  6 continues the uninterrupted trajectory."""
  # Kept: every save (the step-3 save is told committed from discarded by its directory).
  two = {"parallel.islands": 2, "parallel.pods": 2, "train.checkpoint_every": 3}
  two["train.keep_checkpoints"] = 5
  straight = train.run(
    small_config(**{**THREE_PODS, **two}), str(tmp_path / "a"), show_progress=False
  )
  workdir = tmp_path / "b"
  config = _remote(**two, **{"fault.inject": "rejoin:pod0@step8"})
  with launcher.launch([2, 2]) as workers:
    os.environ[auth.TOKEN_ENV] = workers.token
    config.backend.workers = tuple(workers.addresses)

    def operator():  # starts the killed worker again on its address
      deadline = time.time() + 300
      while time.time() < deadline and workers.procs[0].poll() is None:
        time.sleep(0.05)
      workers.start([0])

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    killer = Killer(workdir, [Kill(3, lambda: workers.procs[0].pid, within=0.1)], seed=3)
    with caplog.at_level(logging.WARNING, logger="pwtrain"):
      result = train.run(config, str(workdir), show_progress=False)
    killer.join()
    thread.join(60)
  assert_close(_losses(result), _losses(straight), "losses")
  assert_trees_close(result.state["params"], straight.state["params"], "params")
  live = _pods_live(workdir)  # back at step 8, as the drill says, however soon it answers
  assert live[:3] == [2, 2, 2] and 1 in live[3:7] and live[7:] == [2, 2, 2], live
  assert set(live[live.index(1) : 7]) == {1}, live
  committed = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert committed in ([3, 6, 9, 10], [6, 9, 10]), committed
  if 3 not in committed:
    assert any(r.getMessage().startswith("checkpoint 3 discarded") for r in caplog.records)
  (lost,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pod 0 lost")]
  assert "(compile 0.00 s," in lost and lost.endswith("pod 0's work runs on pod 1"), lost
  assert "Metadata file does not exist" not in capfd.readouterr().err
  for later in ("9", "10"):
    shutil.rmtree(workdir / "checkpoints" / later)
  resumed = train.run(small_config(**{**THREE_PODS, **two}), str(workdir), show_progress=False)
  assert resumed.start_step == 6
  assert_close(_losses(resumed), _losses(straight)[6:], "losses after resuming")
  assert_trees_close(resumed.state["params"], straight.state["params"], "params")
