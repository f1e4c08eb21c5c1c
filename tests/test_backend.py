"""The single controller: islands, compile-once, non-blocking dispatch, island order, trace."""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain.backend import Cluster, Controller, Node, Program, Trace, Transfer


def test_cluster_carves_local_devices():
  cluster = Cluster.local([4, 2, 2])
  assert [i.num_devices for i in cluster.islands] == [4, 2, 2]
  assert len({d for i in cluster.islands for d in i.devices}) == 8
  assert Cluster.local(2)["island1"].devices == tuple(jax.devices()[4:])
  with pytest.raises(ValueError, match="do not fit 8 local devices"):
    Cluster.local([4, 8])
  with pytest.raises(ValueError, match="mesh .* has 2 devices but island 'island0' has 4"):
    Cluster.local([4, 4]).islands[0].mesh({"data": 2})


@dataclasses.dataclass(frozen=True)
class SliceDevice:
  """A stand-in for a TPU device of a multi-slice job (e.g. under Pathways' IFRT proxy): only
  what carving islands reads."""

  id: int
  slice_index: int


def test_islands_never_span_slices():
  # Two slices of 4 devices, interleaved as a multi-slice job may list them.
  devices = [SliceDevice(i, i % 2) for i in range(8)]
  by_slice = lambda island: {d.slice_index for d in island.devices}
  one_each = Cluster.local(2, devices=devices)
  assert [by_slice(i) for i in one_each.islands] == [{0}, {1}]
  assert [len(i.devices) for i in one_each.islands] == [4, 4]
  split = Cluster.local(4, devices=devices)  # the config splits each slice in two
  assert [by_slice(i) for i in split.islands] == [{0}, {0}, {1}, {1}]
  assert len({d for i in split.islands for d in i.devices}) == 8
  for islands in (1, [2, 2, 2]):  # one island over both slices; 3 islands over 2 slices
    with pytest.raises(ValueError, match="an island must lie within one slice"):
      Cluster.local(islands, devices=devices)


def test_island_meshes_come_from_jax_make_mesh_with_auto_axes():
  mesh = Cluster.local(2).islands[1].mesh({"data": 2, "tensor": 2})
  assert mesh.devices.tolist() == [list(jax.devices()[4:6]), list(jax.devices()[6:8])]
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


def heavy(x):
  """~0.1-0.5 s of CPU work; its output depends on every iteration."""

  def body(_, y):
    return jnp.tanh(y @ y.T) / 8.0

  return jax.lax.fori_loop(0, 40, body, x)


def compile_on(controller, island, fn, shape=(512, 512)):
  mesh = controller.cluster[island].mesh({"data": controller.cluster[island].num_devices})
  sharding = NamedSharding(mesh, PartitionSpec())
  arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
  return controller.compile(fn.__name__, fn, island, (arg,), out_shardings=sharding), sharding


def test_dispatch_returns_before_results_are_ready():
  """A 3-node chain across two islands is enqueued, and `run` returns, before its result is
  computed (a state, not a ratio of times: on a loaded machine the dispatch itself is slower)."""
  cluster = Cluster.local([4, 4])
  with Controller(cluster, max_inflight=4) as controller:
    exe0, _ = compile_on(controller, "island0", heavy)
    exe1, sharding1 = compile_on(controller, "island1", heavy)
    program = Program(
      nodes=(
        Node("a", exe0, ("x",)),
        Transfer("a_to_1", ("a", 0), "island1", sharding1),
        Node("b", exe1, (("a_to_1", 0),)),
        Node("c", exe1, (("b", 0),)),
      ),
      outputs={"y": ("c", 0)},
    )
    x = np.eye(512, dtype=np.float32)
    controller.wait()
    t0 = time.perf_counter()
    out = controller.run(program, {"x": x})
    dispatch = time.perf_counter() - t0
    pending = not out["y"].done() or not out["y"].result().is_ready()
    y = out["y"].result()  # launched, maybe not computed
    jax.block_until_ready(y)
    total = time.perf_counter() - t0
  assert pending, (dispatch, total)
  expected = heavy(heavy(heavy(x)))
  np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-6)
  assert y.sharding == sharding1


def test_each_island_runs_programs_in_one_order():
  """Programs dispatched from several threads run in the same order on every island."""
  import threading

  cluster = Cluster.local([4, 4])
  trace = Trace(record_completion=False)
  with Controller(cluster, max_inflight=100, trace=trace) as controller:
    exe0, _ = compile_on(controller, "island0", jnp.sin, (8, 8))
    exe1, sharding1 = compile_on(controller, "island1", jnp.cos, (8, 8))

    def client(k):
      program = Program(
        nodes=(
          Node(f"c{k}_0", exe0, ("x",)),
          Transfer(f"c{k}_t", (f"c{k}_0", 0), "island1", sharding1),
          Node(f"c{k}_1", exe1, ((f"c{k}_t", 0),)),
        ),
        outputs={"y": (f"c{k}_1", 0)},
      )
      for _ in range(5):
        controller.run(program, {"x": np.ones((8, 8), np.float32)})

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    controller.wait()
  order = {}
  for e in trace.events:
    order.setdefault(e.island, []).append(e.name.split("_")[0])
  # Consistent: the sequence of clients seen on island0 is the one seen on island1.
  clients0 = [c for c in order["island0"]]
  clients1 = [c for c in order["island1"]][1::2]  # island1 sees transfer then node per program
  assert clients0 == clients1 and len(clients0) == 20


def test_errors_reach_the_caller_and_later_work_still_runs():
  cluster = Cluster.local(1)
  with Controller(cluster) as controller:
    exe, _ = compile_on(controller, "island0", jnp.sin, (8, 8))
    bad = controller.run(Program((Node("n", exe, ("x",)),), {"y": ("n", 0)}), {"x": "not an array"})
    with pytest.raises(TypeError):
      bad["y"].result()
    good = controller.run(
      Program((Node("n", exe, ("x",)),), {"y": ("n", 0)}), {"x": np.ones((8, 8))}
    )
    np.testing.assert_allclose(np.asarray(good["y"].result()), np.sin(np.ones((8, 8))), rtol=1e-6)


def test_trace_is_chrome_json(tmp_path):
  cluster = Cluster.local([4, 4])
  trace = Trace()
  with Controller(cluster, trace=trace) as controller:
    exe0, _ = compile_on(controller, "island0", heavy)
    program = Program((Node("heavy", exe0, ("x",)),), {"y": ("heavy", 0)})
    for _ in range(3):
      controller.run(program, {"x": np.eye(512, dtype=np.float32)})
    controller.wait()
  path = tmp_path / "trace.json"
  trace.write(str(path))
  events = json.load(open(path))["traceEvents"]
  spans = [e for e in events if e["ph"] == "X"]
  assert len(spans) == 3 and all(e["dur"] > 0 for e in spans)
  # Spans on one island do not overlap: it runs its queue in order.
  for a, b in zip(spans, spans[1:], strict=False):
    assert b["ts"] >= a["ts"] + a["dur"] - 1e-3


def test_traced_completion_survives_donated_outputs():
  """Run concurrently (no serialization), the completion watcher meets outputs that their
  successor has already donated: it skips them, stamps every node, and keeps watching."""
  cluster = Cluster.local([1] * 8)
  trace = Trace()
  with Controller(cluster, trace=trace, serialize_execution=False) as controller:
    sharding = NamedSharding(cluster["island0"].mesh({"data": 1}), PartitionSpec())
    arg = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=sharding)
    first = controller.compile("first", heavy, "island0", (arg,), out_shardings=sharding)
    donating = controller.compile(
      "donating", heavy, "island0", (arg,), out_shardings=sharding, donate_argnums=(0,)
    )
    program = Program((Node("a", first, ("x",)), Node("b", donating, (("a", 0),))), {"y": ("b", 0)})
    for _ in range(3):
      controller.run(program, {"x": np.eye(512, dtype=np.float32)})
    controller.wait()
    deadline = time.time() + 30
    while any(e.done is None for e in trace.events) and time.time() < deadline:
      time.sleep(0.01)
  assert len(trace.events) == 6 and all(e.done is not None for e in trace.events)


def test_max_inflight_bounds_run_ahead():
  cluster = Cluster.local(1)
  with Controller(cluster, max_inflight=1) as controller:
    exe, _ = compile_on(controller, "island0", heavy)
    program = Program((Node("heavy", exe, ("x",)),), {"y": ("heavy", 0)})
    first = controller.run(program, {"x": np.eye(512, dtype=np.float32)})
    controller.run(program, {"x": np.eye(512, dtype=np.float32)})
    controller.run(program, {"x": np.eye(512, dtype=np.float32)})
    # The third run waited for the first program's results before enqueueing.
    assert first["y"].result().is_ready()
  with pytest.raises(ValueError, match="backend.max_inflight_steps=-1 must be >= 0"):
    Controller(cluster, max_inflight=-1)


def test_resource_manager_spreads_clients_then_shares_islands():
  from pwtrain.backend import ResourceManager

  cluster = Cluster.local([2, 2, 2, 2])
  rm = ResourceManager(cluster)
  a = rm.allocate("a", 2, 2)
  b = rm.allocate("b", 2, 2)
  assert [i.name for i in a] == ["island0", "island1"]
  assert [i.name for i in b] == ["island2", "island3"]  # least loaded first
  c = rm.allocate("c", 3, 2)  # more than are free: shares, least loaded, in cluster order
  assert len(c) == 3 and all(rm.load(i.name) == 2 for i in c)
  rm.release("a")
  assert rm.load("island0") == (1 if cluster["island0"] in c else 0)
  with pytest.raises(ValueError, match="5 islands of 2 devices requested, but the cluster has 4"):
    rm.allocate("d", 5, 2)
  with pytest.raises(ValueError, match="already holds islands"):
    rm.allocate("b", 1, 2)


def test_transfers_that_go_by_pull():
  """Distributed mode moves a value between two processes by pull (backend/pulls.py) only when
  each island is on one process, the two layouts match, and the value is neither donated by a
  node (the sender's buffer would be gone before the pull) nor carried into the next program;
  every other transfer keeps the ordered device_put. Islands here are stand-ins that say which
  processes hold them: the rule reads only that and the shardings."""
  from types import SimpleNamespace

  from pwtrain.backend.program import Executable
  from pwtrain.backend.pulls import pulls

  def mesh(*devices):
    return jax.sharding.Mesh(np.array([jax.devices()[d] for d in devices]), ("x",))

  def island(name, processes):
    return SimpleNamespace(name=name, processes=frozenset(processes))

  islands = [island("a", [0]), island("a2", [0]), island("b", [1]), island("c", [0, 1])]
  on = {"a": mesh(0), "a2": mesh(1), "b": mesh(2), "c": mesh(3)}
  wide = mesh(4, 5)

  def info(island_name):
    sharding = NamedSharding(on[island_name], PartitionSpec())
    return jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)

  def node(name, island_name, args=(), donate=()):
    compiled = SimpleNamespace(out_info=(info(island_name), info(island_name)))
    exe = Executable(name, island_name, compiled, 2, None, donate)
    return Node(name, exe, args)

  def to(name, src, island_name, spec=None, on_mesh=None):
    sharding = NamedSharding(on_mesh or on[island_name], spec or PartitionSpec())
    return Transfer(name, src, island_name, sharding)

  program = Program(
    nodes=(
      node("f", "a"),
      node("h", "a"),
      to("ok", ("f", 0), "b"),  # the one pull
      to("donated", ("f", 1), "b"),
      to("carried", ("h", 0), "b"),
      to("spans", ("f", 0), "c"),
      to("same_process", ("f", 0), "a2"),
      to("other_layout", ("f", 0), "b", PartitionSpec("x"), wide),
      node("g", "a", (("f", 1),), donate=(0,)),
    ),
    outputs={"state": ("h", 0)},
    carried=("state",),
  )
  found = pulls(program, islands)
  assert set(found) == {"ok"}
  pull = found["ok"]
  assert (pull.source, pull.destination, pull.number) == (0, 1, 0)
  assert pull.spec.sharding == NamedSharding(on["b"], PartitionSpec())
  assert pull.spec.shape == (4,) and pull.spec.dtype == jnp.float32
  uuids = {pull.uuid(c, s) for c in range(2) for s in range(3)}
  assert len(uuids) == 6  # one name per controller, step and transfer, alike on both sides


def test_puller_moves_values_and_a_failed_value_fails_the_pull(monkeypatch):
  """backend/pulls.Puller on a real transfer server, pulling from itself (one process; the
  server addresses go through a dict instead of the coordination service's store): a value
  arrives bitwise; a value whose node failed is offered as an error, so its pull raises with
  the node's message instead of waiting forever."""
  from pwtrain import processes
  from pwtrain.backend.pulls import Puller

  store = {}
  monkeypatch.setattr(
    processes, "share", lambda key, value, replace=False: store.__setitem__(key, value)
  )
  monkeypatch.setattr(processes, "ask", lambda key, timeout_s=600.0: store[key])
  puller = Puller("test")
  device = jax.devices()[0]
  spec = jax.ShapeDtypeStruct(
    (3, 5), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  x = jax.device_put(np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32), device)
  puller.offer(7, x)
  np.testing.assert_array_equal(np.asarray(puller.pull(0, 7, spec)), np.asarray(x))
  puller.offer_error(8, spec, "0:F0.1: boom")
  with pytest.raises(Exception, match="0:F0.1: boom"):
    np.asarray(puller.pull(0, 8, spec))


def test_a_pull_that_never_arrives_names_its_peer_in_bounded_time(monkeypatch):
  """A pulled value whose peer never offers it (dead or silent) is reported within
  backend.pull_timeout_s, naming the peer, instead of being waited for forever."""
  import time

  from pwtrain import processes
  from pwtrain.backend.pulls import Puller

  store, told = {}, []
  monkeypatch.setattr(
    processes, "share", lambda key, value, replace=False: store.__setitem__(key, value)
  )
  monkeypatch.setattr(processes, "ask", lambda key, timeout_s=600.0: store[key])
  puller = Puller("silent", timeout_s=1.0, on_timeout=told.append)
  device = jax.devices()[0]
  spec = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  puller.offer(1, jax.device_put(np.ones(2, np.float32), device))
  np.asarray(puller.pull(0, 1, spec))  # arrives: nothing to report
  puller.pull(0, 2, spec)  # never offered
  deadline = time.monotonic() + 30
  while not told and time.monotonic() < deadline:
    time.sleep(0.1)
  assert told == [
    "a transfer from process 0 (pull 2) has not arrived after 1 s (backend.pull_timeout_s): "
    "that process is dead or silent"
  ]


def test_a_pull_from_a_lost_peer_fails_at_once(monkeypatch):
  """A pull waiting on a peer that its liveness names lost (`peer_lost`, pwtrain/liveness.py)
  ends within the watchdog's half-second tick, not at backend.pull_timeout_s: `recoverable`
  (elastic pods), it fails as a dead peer's pull does and the next pull connects anew; else
  `on_timeout` is told why, naming the peer."""
  import time

  from pwtrain import processes
  from pwtrain.backend.pulls import Puller

  store, lost, told = {}, [], []
  monkeypatch.setattr(
    processes, "share", lambda key, value, replace=False: store.__setitem__(key, value)
  )
  monkeypatch.setattr(processes, "ask", lambda key, timeout_s=600.0: store[key])
  device = jax.devices()[0]
  spec = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  x = jax.device_put(np.arange(2, dtype=np.float32), device)

  def peer_lost(process):
    return f"process {process} has not beaten for 12.0 s" if lost else None

  for recoverable in (True, False):
    lost.clear()
    puller = Puller("lost", 600.0, told.append, peer_lost, recoverable)
    waiting = puller.pull(0, 3, spec)  # never offered: its peer is silent
    time.sleep(1.5)
    assert not waiting.is_ready() and not told  # a live peer's pull waits
    lost.append(True)
    start = time.monotonic()
    if recoverable:
      while not waiting.is_ready() and time.monotonic() - start < 10:
        time.sleep(0.05)
      assert time.monotonic() - start < 5
      with pytest.raises(jax.errors.JaxRuntimeError):
        np.asarray(waiting)
      lost.clear()
      puller.offer(4, x)
      np.testing.assert_array_equal(np.asarray(puller.pull(0, 4, spec)), np.asarray(x))
    else:
      while not told and time.monotonic() - start < 10:
        time.sleep(0.05)
      assert told == ["process 0 has not beaten for 12.0 s"]
  assert told == ["process 0 has not beaten for 12.0 s"]  # the recoverable puller told nothing


def test_an_unknown_sharding_of_an_outline_is_never_transferred():
  """backend/outline.py: an outlined node's KEPT output (sharding unknown on this process) may
  be read by nodes of its own island only; a transfer or a program output reading it is one
  clear error, before anything is dispatched."""
  from pwtrain.backend.outline import KEPT, Outline, check_reads, without_kept
  from pwtrain.backend.program import Executable

  sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())
  known = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)
  unknown = jax.ShapeDtypeStruct((4,), jnp.float32)
  outline = Outline("f", (known, (unknown, unknown)), ((), {}))
  node = Node("f", Executable("f", "a", outline, 2), ())
  ok = Transfer("ok", ("f", 0), "b", sharding)
  check_reads(Program(nodes=(node, ok), outputs={"x": ("ok", 0)}))
  bad = Transfer("bad", ("f", 1), "b", sharding)
  with pytest.raises(ValueError, match="bad reads output 1 of f, which its piece marks KEPT"):
    check_reads(Program(nodes=(node, bad), outputs={}))
  with pytest.raises(ValueError, match="y reads output 1 of f"):
    check_reads(Program(nodes=(node,), outputs={"y": ("f", 1)}))
  assert without_kept((sharding, KEPT, {"a": KEPT})) == (sharding, None, {"a": None})
  assert without_kept(None) is None
