"""Remote islands: real worker processes on loopback, driven by the same controller.

The workers are started once for the module (each pays a JAX import); every remote result is
compared with embedded mode's for the same config and seed.
"""

import os
import threading
import time

import grpc
import helpers
import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import random_batches, run_program, tiny_test_config

from pwtrain import train
from pwtrain.backend import Trace
from pwtrain.backend.program import Node
from pwtrain.backend.remote import arrays, auth, launcher, saves
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import channel_options
from pwtrain.backend.remote.client import WorkerClient
from pwtrain.checkpoint import Checkpointer
from pwtrain.harness import Harness


@pytest.fixture(scope="module")
def workers():
  with launcher.launch([2, 2]) as w:
    yield w


def stub(address):
  return pb_grpc.WorkerStub(grpc.insecure_channel(address, options=channel_options()))


def remote(config, w):
  os.environ[auth.TOKEN_ENV] = w.token
  config.backend.mode = "remote"
  config.backend.workers = tuple(w.addresses[: config.parallel.islands])
  return config


# -- the wire and the worker ------------------------------------------------------------------


def test_wire_format_refuses_bad_headers():
  good = list(arrays.to_chunks("h", [np.arange(6, dtype=np.int32).reshape(2, 3)]))
  _, [(x, _)] = arrays.from_chunks(good)
  np.testing.assert_array_equal(x, np.arange(6).reshape(2, 3))
  bad_dtype = [good[0], pb.Chunk(leaf=0, header=pb.ArrayHeader(dtype="object", nbytes=8))]
  with pytest.raises(ValueError, match="unsupported dtype"):
    arrays.from_chunks(bad_dtype)
  lying = pb.Chunk(leaf=0, header=pb.ArrayHeader(dtype="int32", shape=[2, 3], nbytes=4))
  with pytest.raises(ValueError, match="does not match"):
    arrays.from_chunks([good[0], lying])
  with pytest.raises(ValueError, match="before its header"):
    arrays.from_chunks([good[0], pb.Chunk(leaf=0, data=b"1234")])
  with pytest.raises(ValueError, match="more bytes"):
    arrays.from_chunks([*good, pb.Chunk(leaf=0, data=b"1234")])


def test_unauthenticated_calls_are_refused(workers):
  s = stub(workers.addresses[0])
  for metadata in ((), auth.call_metadata("not-the-token-at-all")):
    calls = [
      lambda md=metadata: s.Health(pb.Empty(), metadata=md, timeout=10),
      lambda md=metadata: s.Enqueue(pb.EnqueueRequest(), metadata=md, timeout=10),
      lambda md=metadata: s.Put(iter(arrays.to_chunks("x", [np.zeros(3)])), metadata=md),
      lambda md=metadata: list(s.Fetch(pb.FetchRequest(handle="x"), metadata=md, timeout=10)),
      lambda md=metadata: s.Shutdown(pb.Empty(), metadata=md, timeout=10),
    ]
    for call in calls:
      with pytest.raises(grpc.RpcError) as e:
        call()
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
  # Still serving, and the refusals were logged.
  ok = s.Health(pb.Empty(), metadata=auth.call_metadata(workers.token), timeout=10)
  assert ok.island == "island0" and ok.num_devices == 2
  with open(os.path.join(workers.log_dir, "island0.log")) as f:
    assert "missing or wrong token" in f.read()


def test_messages_over_the_size_limit_are_refused(workers):
  s = pb_grpc.WorkerStub(grpc.insecure_channel(workers.addresses[0]))  # no client-side limit
  huge = pb.Chunk(handle="big", num_leaves=0, leaf=-1, data=b"\0" * (arrays.MAX_MESSAGE_BYTES + 1))
  with pytest.raises(grpc.RpcError) as e:
    s.Put(iter([huge]), metadata=auth.call_metadata(workers.token), timeout=10)
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_put_fetch_and_worker_to_worker_transfer(workers):
  md = auth.call_metadata(workers.token)
  s0, s1 = stub(workers.addresses[0]), stub(workers.addresses[1])
  big = np.random.default_rng(0).standard_normal((3, 1 << 19)).astype(np.float32)  # 6 MiB
  leaves = [big, np.arange(4).astype(ml_dtypes.bfloat16), np.int32(7)]
  s0.Put(iter(arrays.to_chunks("v", leaves, uses=0)), metadata=md, timeout=30)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  receive = pb.Receive(
    source=workers.addresses[0],
    handle="v",
    output=pb.Output(handle="w", uses=0),
    shardings=[arrays.sharding_to_proto(s) for s in (split, whole, whole)],
  )
  s1.Enqueue(pb.EnqueueRequest(ops=[pb.Op(name="t", receive=receive)]), metadata=md, timeout=10)
  _, got = arrays.from_chunks(s1.Fetch(pb.FetchRequest(handle="w", release=True), metadata=md))
  assert len(got) == 3
  for (x, _), want in zip(got, leaves, strict=True):
    assert x.dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(x, want)
  before = s0.Health(pb.Empty(), metadata=md, timeout=10).stored_values
  s0.Release(pb.ReleaseRequest(handles=["v"]), metadata=md, timeout=10)
  deadline = time.time() + 10
  while s0.Health(pb.Empty(), metadata=md, timeout=10).stored_values != before - 1:
    assert time.time() < deadline
    time.sleep(0.05)


@pytest.mark.processes
def test_shutdown_rpc_stops_the_worker():
  with launcher.launch([1], names=["solo"]) as w:
    md = auth.call_metadata(w.token)
    reply = stub(w.addresses[0]).Health(pb.Empty(), metadata=md, timeout=30)
    assert (reply.island, reply.num_devices, reply.platform) == ("solo", 1, "cpu")
    stub(w.addresses[0]).Shutdown(pb.Empty(), metadata=md, timeout=10)
    assert w.procs[0].wait(timeout=30) == 0


# -- checkpoints written by the workers (two-phase commit) ------------------------------------


@pytest.fixture()
def stored(workers):
  """Two values, one on each worker, as a remote state of LeafRefs; and the arrays."""
  clients = [WorkerClient(a, workers.token) for a in workers.addresses]
  rng = np.random.default_rng(1)
  values = {"a": rng.standard_normal((4, 6)).astype(np.float32), "b": np.arange(5, dtype=np.int32)}
  handles = {}
  for (name, x), client in zip(values.items(), clients, strict=True):
    handles[name] = f"ckpt-test/{name}/{time.monotonic_ns()}"
    client.put_async(handles[name], [x]).result()
  refs = {
    "params": {
      name: saves.LeafRef(client, handles[name], 0, jax.ShapeDtypeStruct(x.shape, x.dtype))
      for (name, x), client in zip(values.items(), clients, strict=True)
    }
  }
  yield clients, refs, {"params": values}
  for client, handle in zip(clients, handles.values(), strict=True):
    client.release_later(handle)
    client.flush_releases()
    client.close()


def abstract_of(values):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), values)


def test_workers_write_their_parts_and_the_controller_commits(stored, tmp_path):
  clients, refs, values = stored
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3, every=1, part_writer=saves.PendingSave)
  ckpt.save(1, refs, {"position": 1})
  ckpt.wait()
  assert ckpt.all_steps() == [1]
  assert sorted(os.listdir(tmp_path / "ckpt" / "1" / "parts")) == [
    "commit_success.txt",
    "island0",
    "island1",
  ]
  assert os.listdir(ckpt.pending_root) == []  # the parts were moved into the step
  state, data = ckpt.restore(1, abstract_of(values))
  assert data == {"position": 1}
  for name, x in values["params"].items():
    np.testing.assert_array_equal(np.asarray(state["params"][name]), x)
  ckpt.close()


def test_a_failed_part_commits_nothing(stored, tmp_path):
  """One worker cannot write its part (its value failed): the step never appears, the other
  worker's finished part is discarded, and resume still finds the previous step intact."""
  clients, refs, values = stored
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3, every=1, part_writer=saves.PendingSave)
  ckpt.save(1, refs, {"position": 1})
  failed = pb.Execute(executable="no-such-program", outputs=[pb.Output(handle="broken", uses=0)])
  clients[1].enqueue_async([pb.Op(name="fails", execute=failed)]).result()
  broken = dict(refs["params"], b=saves.LeafRef(clients[1], "broken", 0, refs["params"]["b"].aval))
  ckpt.save(2, {"params": broken}, {"position": 2})
  with pytest.raises(saves.SaveFailed, match="island1.*no-such-program"):
    ckpt.wait()
  assert ckpt.all_steps() == [1]
  assert os.listdir(ckpt.pending_root) == []
  step, state, data = ckpt.restore_latest(abstract_of(values))
  assert (step, data) == (1, {"position": 1})
  np.testing.assert_array_equal(np.asarray(state["params"]["a"]), values["params"]["a"])
  ckpt.close()
  clients[1].release_later("broken")


def test_parts_written_but_never_committed_are_not_a_checkpoint(stored, tmp_path):
  """The controller dies between the phases: every part is on disk, the step is not, and the
  next run removes the parts."""
  clients, refs, values = stored
  directory = str(tmp_path / "ckpt")
  ckpt = Checkpointer(directory, keep=3, every=1)
  pending = os.path.join(ckpt.pending_root, "5-crashed")
  os.makedirs(pending)
  fingerprints = saves.PendingSave(refs, pending).wait()  # phase one only
  assert set(fingerprints) == {"params/a", "params/b"}
  assert sorted(os.listdir(pending)) == ["island0", "island1"]
  ckpt.close()
  again = Checkpointer(directory, keep=3, every=1)
  assert again.all_steps() == [] and not os.path.exists(pending)
  again.close()


def test_a_save_lost_with_a_worker_is_discarded_once_the_others_parts_are_written(tmp_path):
  """Worker 0 is SIGKILLed before a save reaches it: the save is discarded (elastic pods), but
  only once worker 1 has written its part (32 MiB: still writing when the loss is known), so
  that the pending directory is removed with nothing writing into it (removed under an Orbax
  save, it made worker 1 warn "Metadata file does not exist"), and nothing of it is left."""
  from pwtrain.backend.faults import IslandLost

  with launcher.launch([1, 1], log_dir=str(tmp_path / "logs")) as w:
    clients = [WorkerClient(a, w.token) for a in w.addresses]
    values = {"a": np.arange(4, dtype=np.float32), "b": np.zeros((8, 1 << 20), np.float32)}
    refs = {}
    for (name, x), client in zip(values.items(), clients, strict=True):
      client.put_async(name, [x]).result()
      refs[name] = saves.LeafRef(client, name, 0, jax.ShapeDtypeStruct(x.shape, x.dtype))
    w.kill(0)
    ckpt = Checkpointer(
      str(tmp_path / "ckpt"), keep=3, every=1, part_writer=saves.PendingSave,
      discard_if=lambda e: isinstance(e, IslandLost),
    )  # fmt: skip
    ckpt.save(1, refs, {"position": 1})
    ckpt.wait()
    assert ckpt.all_steps() == [] and os.listdir(ckpt.pending_root) == []
    ckpt.close()
    with open(tmp_path / "logs" / "island1.log") as f:
      log = f.read()
  assert "async_save" in log  # it wrote its part
  assert "Metadata file does not exist" not in log, log[-2000:]


# -- the controller in remote mode ------------------------------------------------------------


def copied(workers) -> dict:
  """Each worker's Health counters of inputs copied into another sharding (server.py):
  {address: (copied_inputs, copied_bytes)}, since the worker started."""
  md = auth.call_metadata(workers.token)
  health = {a: stub(a).Health(pb.Empty(), metadata=md, timeout=10) for a in workers.addresses}
  return {a: (h.copied_inputs, h.copied_bytes) for a, h in health.items()}


def assert_same_run(config, workers, num_steps=3):
  """Embedded and remote runs of `config` give identical losses and parameters, and the remote
  run copies no input into another sharding on any worker (server.py's promise for training)."""
  batches = random_batches(config, num_steps)
  n = config.parallel.islands
  _, m_local, state_local = run_program(config, batches, devices=jax.devices()[: 2 * n])
  before = copied(workers)  # the module's workers ran other tests first
  _, m_remote, state_remote = run_program(remote(config, workers), batches, jax.devices()[:2])
  assert copied(workers) == before, "the remote run copied inputs (the workers' logs say which)"
  assert [float(m["loss"]) for m in m_remote] == [float(m["loss"]) for m in m_local]
  for a, b in zip(jax.tree.leaves(state_local), jax.tree.leaves(state_remote), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved"])
def test_remote_pipeline_matches_embedded(workers, schedule):
  virtual = (
    {"parallel.virtual_stages": 2, "model.num_layers": 4} if schedule == "interleaved" else {}
  )
  config = tiny_test_config(
    **{
      "parallel.stages": 2,
      "parallel.islands": 2,
      "train.num_microbatches": 2,
      "parallel.schedule": schedule,
      **virtual,
    }
  )
  assert_same_run(config, workers)


@pytest.mark.slow
def test_remote_pods_match_embedded(workers):
  assert_same_run(tiny_test_config(**{"parallel.pods": 2, "parallel.islands": 2}), workers)


@pytest.mark.slow
def test_remote_eval_matches_embedded(workers):
  """The forward-only program on the workers: the same sums as embedded mode, bit for bit."""
  config = tiny_test_config(
    **{"parallel.stages": 2, "parallel.islands": 2, "train.num_microbatches": 2}
  )
  batches = random_batches(config, 2, seed=1)
  sums = []
  for cfg, devices in (
    (config, jax.devices()[:4]),
    (remote(config.copy_and_resolve_references(), workers), jax.devices()[:2]),
  ):
    with Harness.build(cfg, devices) as harness:
      sums.append(harness.evaluate(harness.init(), batches))
  assert sums[1] == sums[0] and sums[0]["tokens"] > 0


def test_remote_trace_has_the_workers_run_times(workers):
  """backend.trace in remote mode: each node's launch (inputs ready) and done come from its
  worker, on the controller's clock; an island runs its executes one after another, each after
  the controller dispatched it. No step copied an input into another sharding (server.py)."""
  config = remote(tiny_test_config(**{"parallel.stages": 2, "parallel.islands": 2}), workers)
  before = copied(workers)  # the module's workers ran other tests first
  trace = Trace()
  with Harness.build(config, jax.devices()[:2], trace=trace) as harness:
    program, state = harness.step_program, harness.init()
    for i, batch in enumerate(random_batches(config, 2)):
      out = harness.step(state, batch, i)
      state = out.state
    out.metrics.result()
  executes = {n.name for n in program.program.nodes if isinstance(n, Node)}
  events = [e for e in trace.events if e.step == 1]
  assert len(events) == len(program.program.nodes)
  slack = 0.005  # the clock offset: from the quickest of a few loopback round trips
  for e in events:
    assert e.launch is not None and e.done is not None, e
    assert e.dispatch - slack <= e.launch <= e.done, e
  for island in ("island0", "island1"):
    runs = sorted((e.launch, e.done) for e in events if e.island == island and e.name in executes)
    assert len(runs) >= 2
    for (_, done), (launch, _) in zip(runs, runs[1:], strict=False):
      assert done <= launch + slack
  spans = [e for e in trace.to_chrome()["traceEvents"] if e["ph"] == "X"]
  assert len(spans) >= len(events)
  assert copied(workers) == before  # the promise of no copy: no input in another sharding


def test_a_program_s_host_inputs_reach_a_worker_in_one_upload(workers, monkeypatch):
  """The host inputs that a worker's nodes read travel in one Put stream (remote/uploads.py),
  each read as its leaves of that value; the worker drops the value after its last read, so
  that only the program's output is left in its store."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from pwtrain.backend import Program

  config = remote(tiny_test_config(**{"parallel.stages": 2, "parallel.islands": 2}), workers)
  puts = []
  put = WorkerClient.put_async
  monkeypatch.setattr(
    WorkerClient,
    "put_async",
    lambda self, handle, *a, **k: puts.append(handle) or put(self, handle, *a, **k),
  )
  with Harness.build(config, jax.devices()[:2]) as harness:
    controller, island = harness.controller, harness.plan.islands[0].name
    sharding = NamedSharding(Mesh(np.array(controller.cluster[island].devices), ("d",)), P())
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)  # noqa: E731
    args = (f32((3,)), f32(()), {"a": f32(()), "b": f32(())})
    mix = lambda x, n, t: x * n + t["a"] - t["b"]  # noqa: E731
    exe = controller.compile("mix", mix, island, args, out_shardings=sharding)
    program = Program((Node("mix", exe, ("x", "n", "t")),), {"y": ("mix", 0)})
    worker, md = stub(controller.cluster[island].worker.address), auth.call_metadata(workers.token)
    health = lambda: worker.Health(pb.Empty(), metadata=md, timeout=10)  # noqa: E731
    before = health().stored_values
    puts.clear()
    inputs = {"x": np.arange(3, dtype=np.float32), "n": np.float32(2)}
    out = controller.run(program, {**inputs, "t": {"a": np.float32(1), "b": np.float32(0.5)}})
    np.testing.assert_array_equal(np.asarray(out["y"].result()), np.arange(3) * 2 + 0.5)
    assert len(puts) == 1 and puts[0].endswith(f"/in@{island}"), puts
    deadline = time.time() + 10
    while health().stored_values != before + 1:  # `y` alone; the inputs' value dropped
      assert time.time() < deadline, (before, health().stored_values)
      time.sleep(0.05)


# -- training: checkpoints, resume, lost workers ----------------------------------------------


def small_config(**overrides):
  """helpers' small run as a 2-stage pipeline on 2 islands of 2 devices, checkpointed every 4."""
  return helpers.small_config(
    **{
      "train.checkpoint_every": 4,
      "parallel.stages": 2,
      "parallel.islands": 2,
      "parallel.devices_per_island": 2,
      **overrides,
    }
  )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The embedded run every remote run must reproduce."""
  workdir = tmp_path_factory.mktemp("embedded")
  return train.run(small_config(), str(workdir), show_progress=False)


@pytest.mark.slow
def test_train_run_launches_workers_and_resumes(uninterrupted, tmp_path, caplog):
  """launch_workers: 8 steps, then resume to 10 from the step-8 checkpoint the workers wrote,
  then embedded mode resumes that run's step-10 checkpoint to 12; same as embedded throughout.
  The workers' logs are in the workdir, and their new ports are no changed setting."""
  config = small_config(**{"backend.mode": "remote", "backend.launch_workers": True})
  config.train.num_steps = 8
  before = launcher.live()  # the module's own workers, if started
  first = train.run(config, str(tmp_path), show_progress=False)
  assert first.final_step == 8
  assert all(g in before for g in launcher.live()), "the run left its workers running"
  assert os.path.isdir(tmp_path / "checkpoints" / "8" / "parts" / "island1")  # not the controller
  config.train.num_steps = 10
  with caplog.at_level("WARNING", logger="pwtrain"):
    second = train.run(config, str(tmp_path), show_progress=False)
  assert second.start_step == 8 and second.final_step == 10
  changes = [r.getMessage() for r in caplog.records if "changed setting" in r.getMessage()]
  assert changes == ["resuming at step 8 with a changed setting: train.num_steps: 8 -> 10"]
  assert sorted(os.listdir(tmp_path / "workers")) == ["island0.log", "island1.log"]
  third = train.run(small_config(), str(tmp_path), show_progress=False)  # embedded
  assert third.start_step == 10 and third.final_step == 12
  want = {r["step"]: r["loss"] for r in uninterrupted.history}
  for row in first.history + second.history + third.history:
    assert row["loss"] == want[row["step"]], row["step"]
  for a, b in zip(jax.tree.leaves(uninterrupted.state), jax.tree.leaves(third.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes(uninterrupted, tmp_path):
  """SIGKILL a worker after the step-4 checkpoint: the run restarts its workers, resumes from
  the last checkpoint and ends with the uninterrupted run's parameters."""
  config = small_config(
    **{
      "backend.mode": "remote",
      "backend.launch_workers": True,
      "fault.max_restarts": 1,
      "fault.heartbeat_s": 0.5,
    }
  )
  killed, before = [], launcher.live()

  def kill_after_first_checkpoint():
    deadline = time.time() + 600
    while time.time() < deadline and not killed:
      ours = [g for g in launcher.live() if g not in before]  # the group train.run launched
      if os.path.isdir(tmp_path / "checkpoints" / "4") and ours:
        killed.append(ours[0].procs[1].pid)
        ours[0].kill(1)
      time.sleep(0.05)

  killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
  killer.start()
  result = train.run(config, str(tmp_path), show_progress=False)
  killer.join(1)
  assert killed, "the worker was never killed"
  assert 4 <= result.start_step < 12 and result.final_step == 12
  for a, b in zip(jax.tree.leaves(uninterrupted.state), jax.tree.leaves(result.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.processes
def test_external_workers_restarted_by_an_operator_are_reset_and_resumed(uninterrupted, tmp_path):
  """Workers the controller did not launch: one is SIGKILLed after the step-4 checkpoint and
  started again on its address by someone else; the controller waits for it, resets the
  survivor (whose queue and store still hold the lost session's work), resumes from the last
  checkpoint and ends with the uninterrupted run's parameters."""
  config = small_config(**{"fault.max_restarts": 1, "fault.heartbeat_s": 0.5})
  with launcher.launch([2, 2]) as w:
    remote(config, w)
    restarted = []

    def operator():
      deadline = time.time() + 600
      while time.time() < deadline and not os.path.isdir(tmp_path / "checkpoints" / "4"):
        time.sleep(0.05)
      w.kill(1)
      time.sleep(2.0)  # the controller notices before the worker is back
      w.start([1])
      restarted.append(True)

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    result = train.run(config, str(tmp_path), show_progress=False)
    thread.join(60)
    assert restarted, "the worker was never restarted"
    with open(os.path.join(w.log_dir, "island0.log")) as f:
      assert "reset by" in f.read()
  assert 4 <= result.start_step < 12 and result.final_step == 12
  for a, b in zip(jax.tree.leaves(uninterrupted.state), jax.tree.leaves(result.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
