"""The drill `wedge:pod<P>@step<N>` in real elastic runs: pod P's islands run a computation that
never ends (pwtrain/elastic/wedge.py), sent as any program is, so their execution makes no
progress while their process lives and answers. Remote mode: the health monitor declares the
worker lost once that op has run past `fault.progress_timeout_s`, kills it, the supervisor
relaunches it, and the pod rejoins. Distributed mode (pwtrain.launch): the process ends itself
(wedged), the others drop its pod, and the launcher starts it again. Every step runs once.
Embedded mode refuses the drill.
"""

import contextlib
import logging
import re
import threading

import pytest
from helpers import ELASTIC_PODS, SGD, TINY, metrics_rows, small_config
from test_distributed import launch, process_logs

from pwtrain import drills, train
from pwtrain.backend.remote import launcher
from pwtrain.errors import ConfigError
from pwtrain.parallel import plan as plan_lib

PROGRESS_TIMEOUT_S = 3.0
HEARTBEAT_S = 0.5
TWO_PODS = ELASTIC_PODS
GUARD_S = 30.0  # a wedged worker still alive this long after the drill is killed by the test


class _Guard(logging.Handler):
  """Takes pod 1's worker process as the drill's line is emitted and, unless the run is over
  within GUARD_S, SIGKILLs it (as a user would have to): without the progress rule the run then
  finishes, the worker lost as a dead one, and the test fails on its lines, not by hanging."""

  def __init__(self):
    super().__init__()
    self.finished, self.killed = threading.Event(), False

  def emit(self, record):
    if record.getMessage().startswith("fault.inject wedge:"):
      (workers,) = launcher.live()
      threading.Thread(target=self._guard, args=(workers.procs[1],), daemon=True).start()

  def _guard(self, proc):
    if not self.finished.wait(GUARD_S) and proc.poll() is None:
      proc.kill()  # a Popen: never a pid reused since
      self.killed = True


REMOTE = {
  "backend.mode": "remote",
  "backend.launch_workers": True,
  "fault.heartbeat_s": HEARTBEAT_S,
  "fault.progress_timeout_s": PROGRESS_TIMEOUT_S,
}


@pytest.mark.slow
@pytest.mark.processes
def test_a_wedged_worker_is_lost_killed_relaunched_and_its_pod_rejoins(tmp_path, caplog):
  """Pod 1's worker is wedged before step 4 is dispatched. It answers every ping, so only the
  progress rule finds it: lost once the op has run PROGRESS_TIMEOUT_S (`is wedged: one op has
  run for ...`), within that plus a few heartbeats of the drill; killed (SIGKILL) and relaunched;
  pod 0 runs step 4 on alone, and pod 1 rejoins at step 8 (the drill `rejoin:`, which waits for
  it there). metrics.jsonl holds steps 1-10 once each, with one pod live between the drop and
  the rejoin."""
  inject = {"fault.inject": "wedge:pod1@step4,rejoin:pod1@step8"}
  guard = _Guard()
  logger = logging.getLogger("pwtrain")
  logger.addHandler(guard)
  try:
    with caplog.at_level(logging.INFO, logger="pwtrain"):
      result = train.run(
        small_config(**TWO_PODS, **REMOTE, **inject), str(tmp_path), show_progress=False
      )
  finally:
    guard.finished.set()
    logger.removeHandler(guard)
  assert not guard.killed, "the wedged worker was never killed by the run"
  assert result.final_step == 10
  rows = [row for row in metrics_rows(tmp_path) if "loss" in row]
  assert [row["step"] for row in rows] == list(range(1, 11))
  live = [row["pods_live"] for row in rows]
  assert live[:3] == [2, 2, 2] and live[3] == 1 and live[7:] == [2, 2, 2], live
  records = {r.getMessage(): r for r in caplog.records}
  messages = list(records)
  (wedged,) = [m for m in messages if m.startswith("fault.inject wedge:pod1@step4: island island1")]
  (lost,) = [
    m for m in messages if re.match(r"island island1 lost: worker \S+ is wedged: one op has run", m)
  ]
  assert f"(fault.progress_timeout_s={PROGRESS_TIMEOUT_S:g})" in lost, lost
  found_s = records[lost].created - records[wedged].created
  assert PROGRESS_TIMEOUT_S <= found_s < PROGRESS_TIMEOUT_S + 4 * HEARTBEAT_S + 2.0, found_s
  assert any(re.match(r"killed worker \S+ \(island island1\): it was lost", m) for m in messages)
  assert any(
    re.match(r"worker island1 \(pid \d+\) was killed by SIGKILL; relaunched", m) for m in messages
  ), messages
  (drop,) = [m for m in messages if m.startswith("pod 1 lost")]
  assert "is wedged" in drop and "at step 4: 1 of 2 pods live" in drop, drop
  assert any(m.startswith("pod 1 rejoined") for m in messages), messages
  assert not any("restart" in m or "the live pods" in m for m in messages), messages


@pytest.mark.parametrize("inject", ["wedge:pod1@mid4", "wedge:pod1@eval4", "wedge:pod2@step4"])
def test_a_wedge_is_of_a_configured_pod_before_a_step(inject, tmp_path):
  """A wedge happens before a step is dispatched (@step<N>), of a pod the run has (refused
  before the mode is looked at)."""
  config = small_config(**TWO_PODS, **{"fault.inject": inject})
  with pytest.raises(ConfigError, match=rf"^fault.inject='{inject}': '{inject}' (is not|needs)"):
    train.run(config, str(tmp_path / "run"), show_progress=False)
  assert not (tmp_path / "run").exists()


def test_embedded_mode_refuses_the_wedge_drill():
  """Embedded mode: every pod computes in the controller's own process, which nothing can
  unwedge from inside; the drill is one line naming fault.inject, its value and what is valid
  (drills.check, before anything is written; checked there, since a wedge the check let through
  would hang this process)."""
  config = small_config(**TWO_PODS, **{"fault.inject": "wedge:pod1@step4"})
  expected = (
    r"^fault.inject='wedge:pod1@step4': 'wedge:' is not a drill of backend.mode='embedded': .*"
    r"use 'kill:' there, or backend.mode='remote' or 'distributed'$"
  )
  with pytest.raises(ConfigError, match=expected):
    drills.check(config, _plan(config))


def _plan(config):
  """The plan of `config`'s layout on this process's devices (what drills.check reads)."""
  with contextlib.closing(plan_lib.make_cluster(config)) as cluster:
    return plan_lib.build(config, cluster)


@pytest.mark.slow
@pytest.mark.processes
def test_a_wedged_process_ends_itself_and_the_launcher_starts_it_again(tmp_path):
  """Distributed mode, 2 pods as 2 processes of pwtrain.launch: pod 1's process is wedged
  before step 2 is dispatched. Its beat goes on, so only its progress check finds it: it says
  `process 1 is wedged: one program has run for S s (wedge, on island1; ...)` and exits with
  status 3, within PROGRESS_TIMEOUT_S and a few heartbeats of the drill; process 0 drops pod 1
  and runs step 2 on alone; the launcher starts process 1 again, and it rejoins at step 4 (the
  drill `rejoin:`, which waits for it there). The run exits 0 with steps 1-5 once each in
  metrics.jsonl."""
  pods = {
    **SGD,
    "parallel.islands": 2,
    "parallel.devices_per_island": 1,
    "parallel.pods": 2,
    "exchange.mode": "sync",
    "train.global_batch": 4,
    "data.streams": 2,
    "data.max_files": 40,
    "train.num_steps": 5,
    "train.checkpoint_every": 100,
    "train.eval_every": 0,
    "train.log_every": 1,
    **{k: v for k, v in TINY.items() if k != "train.global_batch"},
    "fault.elastic": True,
    "fault.heartbeat_s": 1.0,
    "fault.progress_timeout_s": PROGRESS_TIMEOUT_S,
    "fault.inject": "wedge:pod1@step2,rejoin:pod1@step4",
    # Without the progress rule process 0 would wait on its pull from the wedged process for as
    # long as its beat goes on: it gives up after this and stops, so the test fails, not hangs.
    "backend.pull_timeout_s": 60.0,
  }
  run = launch(tmp_path, 2, pods, devices=1, timeout=300)
  logs = process_logs(tmp_path)
  assert run.returncode == 0, run.stdout[-3000:] + logs[-3000:]
  rows = [row for row in metrics_rows(tmp_path) if "loss" in row]
  assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
  assert [row["pods_live"] for row in rows] == [2, 1, 1, 2, 2], rows
  lines = run.stdout.splitlines()
  (wedged,) = [line for line in lines if "fault.inject wedge:pod1@step2: island island1" in line]
  assert wedged.startswith("[p1]"), wedged  # where it runs
  (ended,) = [line for line in lines if "is wedged" in line and line.startswith("[p1]")]
  assert "process 1 is wedged: one program has run for" in ended, ended
  assert f"(wedge, on island1; fault.progress_timeout_s={PROGRESS_TIMEOUT_S:g}); it ends" in ended
  assert any(re.match(r"\[launch\] process 1 \(pid \d+\) exited with status 3", x) for x in lines)
  (drop,) = [line for line in lines if "pod 1 lost" in line]
  assert drop.startswith("[p0]") and "at step 2: 1 of 2 pods live" in drop, drop
  assert any(line.startswith("[launch] process 1 started again") for line in lines), lines
  assert any(line.startswith("[p0]") and "pod 1 rejoined" in line for line in lines), lines


def test_a_remote_wedge_takes_workers_the_run_launches():
  """Remote mode: a wedged worker is killed and relaunched only by the run that launched it;
  on workers started outside the run (backend.launch_workers=False) the drill is refused in one
  line. The check reads the plan's pods and the config's mode (drills.check), so the plan of
  the same layout in embedded mode stands in for the workers."""
  config = small_config(**TWO_PODS, **{"fault.inject": "wedge:pod1@step4"})
  plan = _plan(config)
  config.backend.mode = "remote"
  expected = r"^fault.inject='wedge:pod1@step4': 'wedge:' in backend.mode='remote' takes backend"
  with pytest.raises(ConfigError, match=expected + r".launch_workers=True: .* use 'kill:' there$"):
    drills.check(config, plan)
  config.backend.launch_workers = True
  drills.check(config, plan)
