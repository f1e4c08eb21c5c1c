"""Silent faults in remote mode: a worker that stops answering (SIGSTOP from outside: alive, its
sockets open) or whose execution wedges while its server answers is declared lost within a
bound, every wait on it ends, and it is killed and replaced as a dead one is.

Real worker processes on loopback; the signals come from outside the run (signals.Killer).
"""

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from helpers import ELASTIC_PODS, RowTimes, metrics_rows, small_config
from signals import Kill, Killer

from pwtrain import train
from pwtrain.backend.remote import arrays, auth, launcher, receives, supervisor
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote.client import Monitor, WorkerClient, WorkerLost
from pwtrain.backend.remote.supervisor import _wait_for_workers
from pwtrain.backend.remote.values import rpc_error
from pwtrain.errors import ConfigError

HEARTBEAT_S = 0.5
# A silent worker is declared lost within 3 x (period + each ping's deadline, at least 2 s).
DETECTION_BOUND_S = 3 * (HEARTBEAT_S + max(HEARTBEAT_S, 2.0))
TWO_PODS = {
  **ELASTIC_PODS,
  "backend.mode": "remote",
  "backend.launch_workers": True,
  "fault.heartbeat_s": HEARTBEAT_S,
}


def _workers():
  (workers,) = launcher.live()
  return workers


@pytest.mark.slow
@pytest.mark.processes
def test_a_stopped_worker_is_lost_in_bounded_time_killed_relaunched_and_rejoins(tmp_path, caplog):
  """Pod 1's worker is SIGSTOPped from outside after step 3 (it never answers again, its
  sockets stay open). It is declared lost within the detection bound; pod 0's pulls from it and
  the controller's waits on pod 0 end then, so the run goes on with pod 0 at once; the worker is
  killed and relaunched, pod 1 rejoins (at step 8, as the drill says: the run would end before
  the relaunched worker is up), and every step runs once. A guard SIGKILLs the stopped
  worker 120 s after the stop (as the user who found the hang had to): without the rules the run
  would then finish, but the step gap would be far over the bound."""
  rows = RowTimes(tmp_path, poll_s=0.01)
  stopped: dict = {}
  stop = Kill(after=3, pid=lambda: _workers().procs[1].pid, sig=signal.SIGSTOP)
  killer = Killer(tmp_path, [stop], seed=1)
  finished = threading.Event()  # the guard never signals a pid once the run is over

  def guard():
    while killer.kills[0].at is None:
      if finished.wait(0.05):
        return
    stopped["pid"] = killer.kills[0].sent_to
    if finished.wait(120):
      return
    try:
      os.kill(stopped["pid"], signal.SIGKILL)
      stopped["guard_killed"] = True
    except ProcessLookupError:
      pass

  threading.Thread(target=guard, daemon=True).start()
  try:
    with caplog.at_level(logging.INFO, logger="pwtrain"):
      config = small_config(**TWO_PODS, **{"fault.inject": "rejoin:pod1@step8"})
      result = train.run(config, str(tmp_path), show_progress=False)
  finally:
    finished.set()
  killer.join()
  rows.stop()
  assert "guard_killed" not in stopped, "the stopped worker was never killed by the run"
  assert result.final_step == 10
  live = [row["pods_live"] for row in metrics_rows(tmp_path) if "loss" in row]
  assert [r["step"] for r in metrics_rows(tmp_path) if "loss" in r] == list(range(1, 11))
  assert live[:3] == [2, 2, 2] and 1 in live and live[7:] == [2, 2, 2], live
  stop_at = killer.kills[0].at
  lost = [
    r
    for r in caplog.records
    if re.match(r"island island1 lost: .* missed heartbeat", r.getMessage())
  ]
  assert lost, [r.getMessage() for r in caplog.records]
  detection_s = lost[0].created - stop_at
  assert 0 < detection_s < DETECTION_BOUND_S + 3.0, detection_s
  messages = [r.getMessage() for r in caplog.records]
  assert any(m.startswith("killed worker") and "island1" in m for m in messages), messages
  assert any(
    re.match(r"worker island1 \(pid \d+\) was killed by SIGKILL; relaunched", m) for m in messages
  )
  assert any(m.startswith("pod 1 rejoined") for m in messages), messages
  # Pod 0's first step alone comes within the bound and the drop's cost (not the 120 s guard).
  alone = min(row["step"] for row in metrics_rows(tmp_path) if row.get("pods_live") == 1)
  gap_s = rows.at[alone] - stop_at
  assert gap_s < DETECTION_BOUND_S + 30.0, (gap_s, rows.at)
  print(f"stopped after step 3: lost {detection_s:.1f} s later, alone at {gap_s:.1f} s")


PAUSE_S = 1.0  # two heartbeats: well under the detection bound (3 missed pings)


def _steps_and_live(workdir) -> tuple[list[int], list[int]]:
  """The steps of metrics.jsonl's training rows, in file order (a step written twice shows
  twice), and each row's pods_live."""
  train_rows = [row for row in metrics_rows(workdir) if "loss" in row]
  return [row["step"] for row in train_rows], [row["pods_live"] for row in train_rows]


@pytest.mark.slow
@pytest.mark.processes
def test_a_stop_shorter_than_detection_costs_only_the_pause_and_no_step_twice(tmp_path, caplog):
  """Pod 1's worker is SIGSTOPped after step 3 for PAUSE_S (two heartbeats), then SIGCONTed:
  its pings answer again before 3 are missed, so it is never lost, no pod drops, nothing is
  killed or run again: metrics.jsonl holds steps 1-10 once each, in order (a step written
  twice, e.g. by a drop that ran it again, would show twice), with both pods live in every
  row; and the rows around the pause are at most the pause plus a few steps apart."""
  rows = RowTimes(tmp_path, poll_s=0.01)
  stop = Kill(after=3, pid=lambda: _workers().procs[1].pid, sig=signal.SIGSTOP)
  killer = Killer(tmp_path, [stop], seed=3)
  resumed: dict = {}

  def resume():
    while stop.at is None:
      time.sleep(0.01)
    time.sleep(max(0.0, stop.at + PAUSE_S - time.time()))
    os.kill(stop.sent_to, signal.SIGCONT)
    resumed["at"] = time.time()

  threading.Thread(target=resume, daemon=True).start()
  with caplog.at_level(logging.INFO, logger="pwtrain"):
    result = train.run(small_config(**TWO_PODS), str(tmp_path), show_progress=False)
  killer.join()
  rows.stop()
  assert result.final_step == 10
  steps, live = _steps_and_live(tmp_path)
  assert steps == list(range(1, 11)), steps
  assert live == [2] * 10, live
  messages = [r.getMessage() for r in caplog.records]
  assert not [m for m in messages if " lost" in m or m.startswith("killed worker")], messages
  assert not (tmp_path / "metrics.rolled_back.jsonl").exists()
  assert resumed["at"] - stop.at >= PAUSE_S
  # The pause costs the pause: the longest gap between two rows is under it plus a few steps.
  times = [rows.at[s] for s in sorted(rows.at)]
  steady = sorted(b - a for a, b in zip(times, times[1:], strict=False))[len(times) // 2]
  gap_s = max(b - a for a, b in zip(times, times[1:], strict=False))
  assert gap_s < PAUSE_S + max(5 * steady, 2.0), (gap_s, steady)
  print(f"stopped {resumed['at'] - stop.at:.2f} s: longest gap {gap_s:.2f} s, step {steady:.2f} s")


class _KillOn(logging.Handler):
  """SIGKILLs `proc()` (once) as a log line matching `pattern` is emitted, and waits until it
  is dead: whatever the logging thread does next, it does with that process gone."""

  def __init__(self, pattern: str, proc):
    super().__init__()
    self.pattern, self.proc, self.at = re.compile(pattern), proc, None

  def emit(self, record):
    if self.at is None and self.pattern.search(record.getMessage()):
      proc = self.proc()
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(timeout=30)
      self.at = time.time()


@pytest.mark.slow
@pytest.mark.processes
def test_pod_0_killed_while_pod_1_rejoins_is_a_loss_that_restarts_the_run(tmp_path, caplog):
  """Pod 1's worker is SIGKILLed after step 2 and rejoins at step 7; pod 0's worker is
  SIGKILLed (and dead) as pod 1's worker has rejoined ("worker ... (island island1) rejoined",
  logged before the state is copied onto it), so pod 1's copy from pod 0 always fails: no pod
  holds the state any more. That one path: the rejoin waits for its copy, which fails as pod 0's
  loss (WorkerLost, not a plain RuntimeError of the failed transfer); pod 0 is dropped, which
  leaves no live pod: the loss reaches the supervisor, which restarts the workers and resumes
  from the step-4 checkpoint (fault.max_restarts=1); the run ends at step 10 with steps 1-10 in
  metrics.jsonl once each."""
  overrides = {"fault.inject": "rejoin:pod1@step7", "fault.max_restarts": 1}
  config = small_config(**{**TWO_PODS, **overrides, "train.checkpoint_every": 4})
  killer = Killer(tmp_path, [Kill(after=2, pid=lambda: _workers().procs[1].pid)], seed=2)
  kill_pod0 = _KillOn(r"^worker \S+ \(island island1\) rejoined", lambda: _workers().procs[0])
  logger = logging.getLogger("pwtrain")
  logger.addHandler(kill_pod0)
  try:
    with caplog.at_level(logging.INFO, logger="pwtrain"):
      result = train.run(config, str(tmp_path), show_progress=False)
  finally:
    logger.removeHandler(kill_pod0)
  killer.join()
  assert kill_pod0.at is not None
  assert result.final_step == 10
  messages = [r.getMessage() for r in caplog.records]
  # The path, in order: pod 1 dropped; its rejoin at step 7 waits for its copy from pod 0,
  # which dies: the copy fails as pod 0's loss, so pod 1 never rejoins and dropping pod 0
  # leaves no pod: the loss restarts the run.
  path = (
    r"^pod 1 lost \(.*\) at step [3-6]: 1 of 2 pods live",
    r"^pod 0 lost \(.*\): 0 of 2 pods left, fewer than fault.min_pods=1; stopping",
    r"^island island0 lost: .*; restart 1 of 1: resuming from the last checkpoint",
  )
  elastic = [m for m in messages if re.match(r"^(pod \d|the live pods|.*; restart \d)", m)]
  assert len(elastic) == len(path), elastic
  for line, pattern in zip(elastic, path, strict=True):
    assert re.match(pattern, line), (pattern, elastic)
  assert not [m for m in messages if "Traceback" in m or "RuntimeError" in m], messages
  # How pod 0's worker ended is on record: the restart's line (its log named) or the relaunch's.
  ended = r"^worker island0 \(pid \d+\) was killed by SIGKILL( \(its log: \S+island0\.log\)|;)"
  assert any(re.match(ended, m) for m in messages), messages
  assert [row["step"] for row in metrics_rows(tmp_path) if "loss" in row] == list(range(1, 11))


PULL_DELAY_S = 1.0  # island1's pulls start this late: far over the killer's reaction


@pytest.mark.slow
@pytest.mark.processes
def test_a_step_is_confirmed_once_every_live_pod_holds_its_state(tmp_path, caplog, monkeypatch):
  """island1's worker (pod 1) starts each pull from another worker PULL_DELAY_S late (the
  test-only receives.TEST_DELAY_ENV), so step 3's metrics are ready before pod 1's state of
  step 3, which waits on its pull from island0. Pod 0's worker is SIGSTOPped at once after
  step 3's row: the step is confirmed once every live pod's state of it is computed (a wait-only
  fetch on each worker), so pod 1 holds its state of step 3 when pod 0 stops; pod 0 is declared
  lost, dropped, and pod 1 runs the steps after 3 again from that state: the run ends at step 8
  with steps 1-8 once each. Confirmed on its metrics alone, step 3 would leave pod 1's state
  waiting on the stopped worker: the pull fails with its loss and the run ends with "the live
  pods (1,) read what a lost pod made" (WorkerLost)."""
  monkeypatch.setenv(receives.TEST_DELAY_ENV, f"island1:{PULL_DELAY_S}")  # the workers inherit it
  stop = Kill(after=3, pid=lambda: _workers().procs[0].pid, sig=signal.SIGSTOP, within=0.0)
  killer = Killer(tmp_path, [stop], seed=4)
  overrides = {"train.num_steps": 8, "train.log_every": 1}
  with caplog.at_level(logging.INFO, logger="pwtrain"):
    result = train.run(
      small_config(**{**TWO_PODS, **overrides}), str(tmp_path), show_progress=False
    )
  killer.join()
  assert result.final_step == 8
  steps, live = _steps_and_live(tmp_path)
  assert steps == list(range(1, 9)), steps
  assert live[:3] == [2, 2, 2] and 1 in live[3:], live
  messages = [r.getMessage() for r in caplog.records]
  assert any(re.match(r"^pod 0 lost \(.*\) at step [4-5]: 1 of 2 pods live", m) for m in messages)
  assert not [m for m in messages if m.startswith("the live pods")], messages


@pytest.mark.slow
@pytest.mark.processes
def test_a_pod_lost_as_the_final_state_is_read_is_dropped(tmp_path, caplog):
  """SIGTERM to this process after step 3's row asks the run to checkpoint and stop at the next
  step boundary; pod 1's worker is SIGKILLed (and dead) as "stop requested" is logged, just
  before the run reads its final state (the run's result). That read finds pod 1 lost: it is
  dropped as after a failed step and the survivors' state is read, not a raw WorkerLost that
  ends the run."""
  killer = Killer(tmp_path, [Kill(after=3, pid=os.getpid, sig=signal.SIGTERM)], seed=5)
  kill_pod1 = _KillOn(r"^stop requested: checkpointed step", lambda: _workers().procs[1])
  logger = logging.getLogger("pwtrain")
  logger.addHandler(kill_pod1)
  try:
    with caplog.at_level(logging.INFO, logger="pwtrain"):
      result = train.run(small_config(**TWO_PODS), str(tmp_path), show_progress=False)
  finally:
    logger.removeHandler(kill_pod1)
  killer.join()
  assert kill_pod1.at is not None
  stopped = result.final_step
  assert 3 <= stopped < 10, stopped
  messages = [r.getMessage() for r in caplog.records]
  dropped = rf"^pod 1 lost \(.*\) during the final read after step {stopped}: 1 of 2 pods live"
  assert any(re.match(dropped, m) for m in messages), messages
  assert "params" in result.state, list(result.state)


def _external_worker(island: str, token: str) -> subprocess.Popen:
  """A worker started by someone else (not this process's launcher: nothing here kills it);
  `_ready` reads its address."""
  cmd = [sys.executable, "-m", "pwtrain.backend.remote.worker", f"--island={island}"]
  return subprocess.Popen(
    [*cmd, "--devices=1"],
    env={**os.environ, auth.TOKEN_ENV: token},
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )


def _ready(proc: subprocess.Popen) -> tuple[subprocess.Popen, str]:
  line = proc.stdout.readline()
  assert line.startswith("READY "), line
  return proc, f"127.0.0.1:{line.split()[1]}"


TOKEN = "t" * 32


@pytest.fixture(scope="module")
def external():
  """Two workers started outside this process, island0 and island1: (process, address) each."""
  procs = []
  try:
    for island in ("island0", "island1"):  # started together
      procs.append(_external_worker(island, TOKEN))
    yield [_ready(proc) for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
      proc.wait()


@pytest.mark.processes
def test_a_wait_only_fetch_sends_nothing_and_leaves_the_value(external):
  """A wait-only Fetch (how a step's confirmation waits for its state) answers an empty stream
  once the value is there, waiting for one still to come; the value is neither read nor
  released: a value announced for one read is still there for it afterwards."""
  (_, address0), _ = external
  client = WorkerClient(address0, TOKEN, timeout_s=60)
  try:
    client.put_async("once", [np.arange(3, dtype=np.float32)], uses=1).result()
    assert client.fetch("once", wait_only=True) == []
    np.testing.assert_array_equal(client.fetch("once")[0], [0.0, 1.0, 2.0])  # its one read
    later = threading.Timer(0.5, lambda: client.put_async("later", [np.ones(1)]).result())
    later.start()
    start = time.monotonic()
    assert client.fetch("later", wait_only=True) == []  # announced after the call came
    assert time.monotonic() - start >= 0.4
    later.join()
  finally:
    client.close()


@pytest.mark.processes
def test_a_worker_that_refuses_the_token_is_one_error_at_once(external, monkeypatch):
  """The supervisor waiting for external workers to come back does not take a refused token
  (or TLS handshake) for a worker not up yet: one line, at once."""
  from pwtrain.config import load

  overrides = {"backend.mode": "remote", "backend.workers": (external[1][1],)}
  config = load("palm_tiny", overrides)
  monkeypatch.setenv("PWTRAIN_TEST_WRONG_TOKEN", "x" * 32)
  config.backend.token_env = "PWTRAIN_TEST_WRONG_TOKEN"
  start = time.monotonic()
  with pytest.raises(ConfigError, match=r"refuses the token \(missing or wrong pwtrain token\)"):
    _wait_for_workers(config)
  assert time.monotonic() - start < 10


@pytest.mark.processes
def test_a_pull_from_a_worker_declared_lost_ends_then_as_its_loss(external):
  """island0's worker is SIGSTOPped, and island1 pulls from it a value it will never send.
  Once the monitor declares island0 lost (3 missed pings), island1 abandons the pull at once
  (it would wait for as long as island0 is stopped: nothing closes its connection), and the
  controller's fetch of the pulled value fails as island0's loss (WorkerLost), not as the
  transfer's error. Nothing kills island0: it was started outside this process."""
  import jax

  (p0, address0), (_, address1) = external
  a, b = (WorkerClient(address, TOKEN, timeout_s=60) for address in (address0, address1))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  sharding = arrays.sharding_to_proto(
    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )

  def pull(name, handle, into):
    op = pb.Receive(source=address0, handle=handle, output=pb.Output(handle=into))
    op.shardings.append(sharding)
    b.enqueue_async([pb.Op(name=name, receive=op)]).result()

  a.put_async("w", [np.ones(1, np.float32)], uses=1).result()
  pull("warm", "w", "w1")  # island1 is connected to island0, as in a run
  np.testing.assert_array_equal(b.fetch("w1", release=True)[0], [1.0])
  os.kill(p0.pid, signal.SIGSTOP)
  pull("copy", "x", "y")
  monitor = Monitor([a, b], 0.5, isolate=True)
  a.monitor = b.monitor = monitor
  start = time.monotonic()
  with pytest.raises(grpc.RpcError) as e:  # the deadline: only if the pull is never abandoned
    stream = b.stub.Fetch(pb.FetchRequest(handle="y"), metadata=b._metadata, timeout=60)
    arrays.from_chunks(stream)
  monitor.stop()
  assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
  assert f"transfer copy from {address0} failed: {address0} was declared lost" in e.value.details()
  assert time.monotonic() - start < monitor.bound_s + 5
  lost = rpc_error(b, e.value, frozenset({"island1"}))  # what the controller raises
  assert isinstance(lost, WorkerLost) and lost.island == "island0", lost
  assert p0.poll() is None  # not this process's to kill: someone restarts it


@pytest.mark.processes
def test_a_wedged_worker_is_lost_once_one_op_runs_too_long(caplog):
  """A worker whose execution queue runs a computation that never ends answers Health all the
  same; the monitor declares it lost once the op has run for progress_timeout_s, and, launched
  here, kills it (in a training run, with the drill `wedge:`: test_wedge_drill.py). How it
  ended is the line a supervisor's restart logs, naming its log."""
  progress_timeout_s = 1.0
  import jax

  from pwtrain.elastic.wedge import forever  # the drill's computation that never ends

  with launcher.launch([1]) as workers:
    client = WorkerClient(workers.addresses[0], workers.token, timeout_s=60)
    monitor = Monitor([client], 0.2, isolate=True, progress_timeout_s=progress_timeout_s)
    client.monitor = monitor
    try:
      x = np.zeros(1, np.float32)
      exported = jax.export.export(jax.jit(forever), platforms=("cpu",))(x)
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
      client.compile("forever", bytes(exported.serialize()), mesh, (), [1], None)
      client.put_async("x", [x], uses=1).result()
      run = pb.Execute(executable="forever", args=["x"], outputs=[pb.Output(handle="y", uses=-1)])
      client.enqueue_async([pb.Op(name="forever", execute=run)]).result()
      start = time.monotonic()
      while not client.lost and time.monotonic() - start < 20:
        time.sleep(0.05)
      assert client.lost and "is wedged: one op has run for" in client.lost, client.lost
      assert time.monotonic() - start < progress_timeout_s + 10
      workers.procs[0].wait(timeout=10)  # killed: a stopped or wedged worker is replaced
      with caplog.at_level(logging.WARNING, logger="pwtrain"):
        supervisor._log_exits(workers)
      ended = r"^worker island0 \(pid \d+\) was killed by SIGKILL \(its log: \S+/island0\.log\)$"
      assert [m for m in caplog.messages if re.match(ended, m)], caplog.messages
    finally:
      monitor.stop()
      client.close()
