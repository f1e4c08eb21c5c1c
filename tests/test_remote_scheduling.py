"""A remote worker's queue (backend/remote/server.py) on a real worker process on loopback: no
silent copy of an input whose sharding differs from its program's, and a priority program
placed ahead of queued training work.

One worker of two devices is started for the module; a program whose input is a value not yet
put on the worker holds the worker's queue (the worker waits for the input), which is how the
priority test keeps work queued behind it.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain.backend import Cluster, Controller, Node, Program, Trace, Transfer
from pwtrain.backend.remote import launcher
from pwtrain.backend.remote.values import Ref, RemoteValue


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  with launcher.launch([2, 1], log_dir=str(tmp_path_factory.mktemp("workers"))) as w:
    yield w


@pytest.fixture(scope="module")
def controller(workers):
  cluster = Cluster.connect(workers.addresses, workers.token, devices=jax.devices()[:2])
  with Controller(cluster, max_inflight=16, trace=Trace()) as controller:
    yield controller
  cluster.close()


@pytest.fixture()
def pair(controller):
  """The controller, and each island's sharding of a whole array over its devices."""
  shardings = {}
  for island, n in (("island0", 2), ("island1", 1)):
    mesh = controller.cluster[island].mesh({"d": n})
    shardings[island] = NamedSharding(mesh, PartitionSpec())
  return controller, shardings


def _health(controller):
  return controller.cluster["island0"].worker.health()


def _shardings(controller):
  mesh = controller.cluster["island0"].mesh({"d": 2})
  return NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())


def _program(controller, name, fn, takes, gives, island="island0"):
  """A one-node program on `island`: x (in `takes`) -> y (in `gives`)."""
  arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=takes)
  exe = controller.compile(name, fn, island, (arg,), out_shardings=gives)
  return Program((Node(name, exe, ("x",)),), {"y": (name, 0)})


def _log(workers) -> str:
  with open(os.path.join(workers.log_dir, "island0.log")) as f:
    return f.read()


def test_an_input_in_another_sharding_is_a_counted_logged_copy(controller, workers):
  """A value made split over the island's two devices, read twice by a program that takes it
  whole: both reads copy it (8 float32s, 32 bytes each), both copies are counted in Health, and
  the first alone is logged, with the bytes and both shardings."""
  split, whole = _shardings(controller)
  make = _program(controller, "make_split", lambda x: x + 1, whole, split)
  read = _program(controller, "read_whole", lambda x: x * 2, whole, whole)
  before = _health(controller)
  made = controller.run(make, {"x": np.arange(8, dtype=np.float32)})["y"]
  outs = [controller.run(read, {"x": made})["y"] for _ in range(2)]
  for out in outs:
    np.testing.assert_array_equal(np.asarray(out.result()), (np.arange(8) + 1) * 2)
  after = _health(controller)
  assert after.copied_inputs - before.copied_inputs == 2
  assert after.copied_bytes - before.copied_bytes == 2 * 32
  logged = [
    line for line in _log(workers).splitlines() if "read_whole" in line and "copied" in line
  ]
  assert len(logged) == 1, logged
  assert "input 0 ((8,), 32 bytes) arrived as P('d',); the program takes P()" in logged[0]


def test_an_input_the_program_does_not_read_keeps_its_sharding(controller, workers):
  """A program compiled for a split input it does not read (a zero_bubble W's residuals of the
  input's gradient alone): the worker takes it in the sharding it was compiled for, as it
  arrives, and copies nothing (jax.export drops the sharding of an unread input: the worker
  would take it whole and copy it each run, as it did)."""
  split, whole = _shardings(controller)
  make = _program(controller, "make_split_too", lambda x: x + 1, whole, split)
  args = tuple(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=s) for s in (whole, split))
  exe = controller.compile("ignore_second", lambda x, unread: x * 2, "island0", args,
                           out_shardings=whole)  # fmt: skip
  ignore = Program((Node("ignore_second", exe, ("x", "unread")),), {"y": ("ignore_second", 0)})
  before = _health(controller)
  made = controller.run(make, {"x": np.arange(8, dtype=np.float32)})["y"]
  out = controller.run(ignore, {"x": np.arange(8, dtype=np.float32), "unread": made})["y"]
  np.testing.assert_array_equal(np.asarray(out.result()), np.arange(8) * 2)
  after = _health(controller)
  assert (after.copied_inputs, after.copied_bytes) == (before.copied_inputs, before.copied_bytes)
  assert "ignore_second" not in _log(workers)


def _one(executable, tag):
  """A one-node program of `executable`: x -> y, its node named `tag`."""
  return Program((Node(tag, executable, ("x",)),), {"y": (tag, 0)})


def _gate(controller, whole, island="island0"):
  """A value `island`'s worker does not have yet: a program reading it holds the worker's queue
  until the test puts it (under the returned handle)."""
  worker = controller.cluster[island].worker
  handle = f"gate-{time.monotonic_ns()}"
  aval = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=whole)
  ref = Ref(worker, handle, jax.tree.structure(0), (aval,), frozenset({island}))
  return RemoteValue(ref), handle


def _wait_taken(controller, *islands):
  """Until each island's worker has taken all the work queued on it (and waits in it)."""
  workers = [controller.cluster[island].worker for island in islands]
  deadline = time.monotonic() + 60
  while any(worker.health().pending_ops for worker in workers):
    assert time.monotonic() < deadline, "a worker never took its work"
    time.sleep(0.01)


def test_a_priority_program_goes_ahead_of_queued_steps_on_its_worker(controller):
  """The worker has begun `hold` (it waits for its input) and three steps are queued behind it:
  a priority program `p1` dispatched now runs right after `hold`, ahead of all three (it waits
  for 0 queued steps; in arrival order it would wait for 3). A priority program `p2` that reads
  step s2's output goes after s2 (ahead of s3), and after p1: the client's order."""
  _, whole = _shardings(controller)
  add = _program(controller, "add", lambda x: x + 1, whole, whole).nodes[0].executable
  x = np.zeros(8, np.float32)
  controller.trace.events.clear()
  gate, handle = _gate(controller, whole)
  outs = {"hold": controller.run(_one(add, "hold"), {"x": gate})["y"]}
  worker = controller.cluster["island0"].worker
  _wait_taken(controller, "island0")  # it has taken `hold` and waits in it
  for tag in ("s1", "s2", "s3"):
    outs[tag] = controller.run(_one(add, tag), {"x": x})["y"]
  outs["p1"] = controller.run(_one(add, "p1"), {"x": x}, priority=True)["y"]
  outs["p2"] = controller.run(_one(add, "p2"), {"x": outs["s2"]}, priority=True)["y"]
  worker.put_async(handle, [np.zeros(8, np.float32)], [whole], 1).result()
  for out in outs.values():
    out.result()
  np.testing.assert_array_equal(np.asarray(outs["p2"].result()), np.full(8, 2.0))
  controller._dispatcher.collect_trace()
  ran = [e.name for e in sorted(controller.trace.events, key=lambda e: e.launch)]
  assert ran == ["hold", "p1", "s1", "s2", "p2", "s3"], ran
  assert ran.index("p1") - 1 == 0  # queued steps p1 waited for


def test_a_flood_of_priority_programs_never_stops_the_queued_steps(controller):
  """Three steps queued behind `hold` and six priority programs: AHEAD (4) of them go ahead,
  then a step runs before the rest (remote/ordered.py): serving slows training, never stops it."""
  from pwtrain.backend.remote.ordered import AHEAD

  _, whole = _shardings(controller)
  add = _program(controller, "add", lambda x: x + 1, whole, whole).nodes[0].executable
  x = np.zeros(8, np.float32)
  controller.trace.events.clear()
  gate, handle = _gate(controller, whole)
  outs = [controller.run(_one(add, "hold"), {"x": gate})["y"]]
  worker = controller.cluster["island0"].worker
  _wait_taken(controller, "island0")
  outs += [controller.run(_one(add, f"s{i}"), {"x": x})["y"] for i in (1, 2, 3)]
  outs += [controller.run(_one(add, f"p{i}"), {"x": x}, priority=True)["y"] for i in range(1, 7)]
  worker.put_async(handle, [np.zeros(8, np.float32)], [whole], 1).result()
  for out in outs:
    out.result()
  controller._dispatcher.collect_trace()
  ran = [e.name for e in sorted(controller.trace.events, key=lambda e: e.launch)]
  assert AHEAD == 4 and ran == ["hold", "p1", "p2", "p3", "p4", "s1", "p5", "p6", "s2", "s3"], ran


def test_a_priority_reader_of_the_published_state_reads_the_latest_step_run_before_it(controller):
  """The trainer's case (run last: it turns publishing on): `step` donates the published state
  and publishes its successor. With step s0 run, `hold` taken and s1, s2 queued, a priority
  reader of Latest("x") goes ahead of s1 and s2 and reads s0's state, on the worker, before s1
  donates it (in arrival order it would read s2's); one sent once s2 is done reads s2's."""
  from pwtrain.backend.program import Latest

  _, whole = _shardings(controller)
  arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=whole)
  step = controller.compile(
    "step", lambda x: x + 1, "island0", (arg,), out_shardings=whole, donate_argnums=(0,)
  )
  read = _program(controller, "read", lambda x: x * 10, whole, whole).nodes[0].executable
  controller.start_publishing()

  def one_step(tag, state):
    return controller.run(
      Program((Node(tag, step, ("x",)),), {"x": (tag, 0)}, ("x",)), {"x": state}
    )

  reader = Program((Node("r", read, ("w",)),), {"y": ("r", 0)})
  state = one_step("s0", np.ones(8, np.float32))["x"]  # 2
  state.result()
  gate, handle = _gate(controller, whole)
  controller.run(_one(read, "hold"), {"x": gate})
  worker = controller.cluster["island0"].worker
  _wait_taken(controller, "island0")  # it has taken `hold` and waits in it
  state = one_step("s1", state)["x"]  # 3
  state = one_step("s2", state)["x"]  # 4
  early = controller.run(reader, {"w": Latest("x")}, priority=True)["y"]
  worker.put_async(handle, [np.zeros(8, np.float32)], [whole], 1).result()
  np.testing.assert_array_equal(np.asarray(state.result()), np.full(8, 4.0))
  late = controller.run(reader, {"w": Latest("x")}, priority=True)["y"]
  np.testing.assert_array_equal(np.asarray(early.result()), np.full(8, 20.0))
  np.testing.assert_array_equal(np.asarray(late.result()), np.full(8, 40.0))


def test_a_priority_program_takes_one_place_on_every_worker_it_touches(pair):
  """Worker 0 holds program p0 while worker 1 has begun p2 (its node waits for p2's transfer
  from worker 0, queued behind p0): a priority program over both workers (a node on each, a
  transfer between) goes after p2 on both, ahead of the queued p3, so both workers run every
  program they share in one order. Placed by each worker alone it would go before p2 on worker
  0 and after it on worker 1; sent as ordinary, after p3 on both."""
  controller, shardings = pair
  add = {i: _program(controller, f"add{i}", lambda x: x + 1, s, s, i).nodes[0].executable
         for i, s in shardings.items()}  # fmt: skip

  def across(tag):
    nodes = (
      Node(f"{tag}a", add["island0"], ("x",)),
      Transfer(f"{tag}t", (f"{tag}a", 0), "island1", shardings["island1"]),
      Node(f"{tag}b", add["island1"], ((f"{tag}t", 0),)),
    )
    return Program(nodes, {"y": (f"{tag}b", 0)})

  controller.trace.events.clear()
  gate, handle = _gate(controller, shardings["island0"])
  x = np.zeros(8, np.float32)
  outs = [controller.run(_one(add["island0"], "p0"), {"x": gate})["y"]]
  outs.append(controller.run(across("p2"), {"x": x})["y"])
  _wait_taken(controller, "island1")  # p2b taken; p2a queued behind p0 on island0
  outs.append(controller.run(across("p3"), {"x": x})["y"])
  outs.append(controller.run(across("u"), {"x": x}, priority=True)["y"])
  controller.cluster["island0"].worker.put_async(handle, [x], [shardings["island0"]], 1).result()
  np.testing.assert_array_equal(np.asarray(outs[-1].result()), np.full(8, 2.0))
  for out in outs:
    out.result()
  controller._dispatcher.collect_trace()
  for island, want in (("island0", ["p0", "p2a", "ua", "p3a"]), ("island1", ["p2b", "ub", "p3b"])):
    events = [e for e in controller.trace.events if e.island == island and e.launch is not None]
    ran = [e.name for e in sorted(events, key=lambda e: e.launch) if not e.name.endswith("t")]
    assert ran == want, (island, ran)
