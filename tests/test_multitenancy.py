"""Multi-tenancy: several clients share one controller and its islands, from their own threads.

Each client is a thread with its own programs (collectives inside islands of 4 devices, some
programs crossing both islands, in opposite orders). They must all finish (no deadlock), give
exact results, keep their errors to themselves, and every island must run the programs in one
global order (gang scheduling), which is what keeps interleaved collectives from deadlocking.
"""

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain.backend import Cluster, Controller, Node, Program, ResourceManager, Trace, Transfer

NUM_ITERATIONS = 25
TIMEOUT_S = 120  # far above the few seconds this takes: only a deadlock gets near it
MOD = 97.0  # keeps every value a small integer, so float32 results are exact


def mix(x, offset):
  """What one node computes, in numpy: every device adds the all-reduce of all shards."""
  shards = x.reshape(4, -1)
  return np.mod(shards + shards.sum(0) + offset, MOD).reshape(-1)


def compile_mix(controller, island, offset):
  """`mix` as a shard_map over the island's 4 devices: a psum inside the island."""
  mesh = island.mesh({"d": island.num_devices})
  sharding = NamedSharding(mesh, PartitionSpec("d"))

  def fn(x):
    body = lambda s: jnp.mod(s + jax.lax.psum(s, "d") + offset, MOD)
    return jax.shard_map(
      body, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d")
    )(x)

  arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
  exe = controller.compile(f"mix{offset}", fn, island.name, (arg,), out_shardings=sharding)
  return exe, sharding


def client_program(tag, route, executables, shardings):
  """Two `mix` nodes on each island of `route` in turn, with a transfer between islands."""
  nodes, ref = [], "x"
  for k, island in enumerate(route):
    if k:
      nodes.append(Transfer(f"{tag}_t{k}", ref, island, shardings[island]))
      ref = (f"{tag}_t{k}", 0)
    for j in range(2):
      name = f"{tag}_{k}{j}"
      nodes.append(Node(name, executables[island], (ref,)))
      ref = (name, 0)
  return Program(tuple(nodes), {"y": ref})


def run_clients(targets):
  """Runs each target on its own thread; fails on any exception or if one outlives TIMEOUT_S."""
  errors = []

  def guarded(fn):
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread below
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
  for t in threads:
    t.start()
  for t in threads:
    t.join(TIMEOUT_S)
  assert not any(t.is_alive() for t in threads), "clients still running: deadlock?"
  if errors:
    raise errors[0]


def test_clients_share_islands_with_exact_results_and_one_order_per_island():
  cluster = Cluster.local([4, 4])
  rm = ResourceManager(cluster)
  trace = Trace(record_completion=False)
  # Client name -> order in which its program visits its (virtual) islands.
  routes = {"a": (0, 1), "b": (1, 0), "c": (0,), "d": (0, 1, 0)}
  # max_inflight=2 makes the clients keep popping the shared run-ahead bound at once.
  with Controller(cluster, max_inflight=2, trace=trace) as controller:
    programs, expected = {}, {}
    for offset, (tag, route) in enumerate(routes.items()):
      islands = rm.allocate(tag, len(set(route)), 4)
      assert all(rm.load(i.name) >= 1 for i in islands)
      compiled = {i.name: compile_mix(controller, i, offset) for i in islands}
      executables = {name: exe for name, (exe, _) in compiled.items()}
      shardings = {name: sharding for name, (_, sharding) in compiled.items()}
      route = [islands[v].name for v in route]
      programs[tag] = (client_program(tag, route, executables, shardings), shardings[route[0]])
      expected[tag] = (offset, 2 * len(route))  # `mix` with this offset, this often
    # "c" got the least loaded island (a tie: the first).
    assert rm.load("island0") == 4 and rm.load("island1") == 3

    results = {tag: [] for tag in routes}

    def client(tag):
      program, sharding = programs[tag]
      rng = np.random.default_rng(ord(tag))
      for _ in range(NUM_ITERATIONS):
        x = rng.integers(0, int(MOD), size=8).astype(np.float32)
        out = controller.run(program, {"x": jax.device_put(x, sharding)})
        results[tag].append((x, out["y"]))  # not waited on: the clients run ahead
      for _, y in results[tag]:
        jax.block_until_ready(y.result())

    run_clients([lambda t=tag: client(t) for tag in routes])
    controller.wait()

  for tag, runs in results.items():
    assert len(runs) == NUM_ITERATIONS
    for x, y in runs:
      np.testing.assert_array_equal(np.asarray(y.result()), _repeat(mix, x, *expected[tag]))

  # Each island launched its work in enqueue order, one program's nodes together.
  per_island = {}
  for e in trace.events:
    per_island.setdefault(e.island, []).append(e)
  for island, events in per_island.items():
    assert all(e.launch is not None for e in events)
    assert [e.launch for e in events] == sorted(e.launch for e in events), island
    steps = [step for step, _ in itertools.groupby(e.step for e in events)]
    assert len(steps) == len(set(steps)), f"{island} interleaved two programs' nodes"
  # Gang scheduling: the programs both islands run come in the same relative order on both.
  order = {
    island: [step for step, _ in itertools.groupby(e.step for e in events)]
    for island, events in per_island.items()
  }
  common = set(order["island0"]) & set(order["island1"])
  assert len(common) == 3 * NUM_ITERATIONS  # a, b and d cross islands; c stays on one
  assert [s for s in order["island0"] if s in common] == [
    s for s in order["island1"] if s in common
  ]


def test_a_clients_error_stays_with_that_client():
  """A failing client neither stops nor raises in the others, even through the shared bound."""
  cluster = Cluster.local([4, 4])
  with Controller(cluster, max_inflight=1) as controller:
    exe0, sharding0 = compile_mix(controller, cluster["island0"], 1)
    exe1, sharding1 = compile_mix(controller, cluster["island1"], 2)
    good = client_program(
      "g",
      ["island0", "island1"],
      {"island0": exe0, "island1": exe1},
      {"island0": sharding0, "island1": sharding1},
    )
    bad = Program((Node("b", exe1, ("x",)),), {"y": ("b", 0)})
    outcomes = {"good": [], "bad": []}

    def good_client():
      for i in range(NUM_ITERATIONS):
        x = np.full(8, i, np.float32)
        outcomes["good"].append((x, controller.run(good, {"x": jax.device_put(x, sharding0)})))

    def bad_client():
      for _ in range(NUM_ITERATIONS):
        outcomes["bad"].append(controller.run(bad, {"x": "not an array"}))

    run_clients([good_client, bad_client])
    controller.wait()  # the bad client's errors are not raised here either

  for out in outcomes["bad"]:
    assert isinstance(out["y"].exception(), TypeError)
  for x, out in outcomes["good"]:
    expected = _repeat(mix, _repeat(mix, x, 1, 2), 2, 2)
    np.testing.assert_array_equal(np.asarray(out["y"].result()), expected)


def _repeat(fn, x, offset, times):
  for _ in range(times):
    x = fn(x, offset)
  return x
