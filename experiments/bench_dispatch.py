"""Dispatch throughput: chains of tiny gang-scheduled computations through pwtrain's Controller
vs plain JAX (the Pathways microbenchmark, Barham et al. 2022, Sec. 5.1, Figs. 5-6), a sweep of
the computation size, and several clients sharing the islands (multi-tenancy).

Run (8 simulated CPU devices; about 3 minutes on 2 cores):
  python experiments/bench_dispatch.py
  python experiments/bench_dispatch.py --sizes=0,64 --repeats=3 --clients=1,2 --out=/tmp/bd.json
Options: --num_computations (chain length, 128), --sizes (per-device matmul n per computation),
--repeats (timed blocks per method and size), --tolerance (for the crossover), --clients,
--mt_sizes, --mt_programs, --unserialized (also the unsafe asynchronous variants, see below),
--plot, --out.

The computation. One island of all 8 devices, mesh axis "d". Each computation is one compiled
SPMD function (a shard_map): every device adds, if n > 0, 1e-3 * mean(tanh(x * W) @ W) for its
own n x n block W (the "computation size", 2 n^3 flops per device), then all devices all-reduce
the scalar (psum over "d") and add 1. Computation i consumes the output of computation i-1, so
the chain is sequential and every computation is gang-scheduled on all 8 devices.

Three ways to run a chain of --num_computations (K) computations, each both ways:
  OpByOp   pwtrain: K calls of `controller.run` with a one-node Program each, back to back, each
                    fed the previous call's output future (max_inflight=K: never waits);
           jax:     K calls of the jitted function, each followed by `block_until_ready`.
  Chained  pwtrain: ONE Program of K nodes (node i reads node i-1), one `controller.run`;
           jax:     JAX has no multi-computation program: the baseline is the same K-call loop.
  Fused    pwtrain: one node compiled from a lax.fori_loop over the K steps, one `run`;
           jax:     the same fori_loop function, jitted, one call.
Why jax blocks after each call: on this CPU backend, K jitted collectives issued back to back
without waiting (JAX's async dispatch) deadlock: XLA:CPU runs each device's part of a
computation on a shared thread pool, a run-ahead computation's participants take threads that
an earlier computation's last participant needs, and XLA aborts after 40 s ("Expected 8 threads
to join the rendezvous, but only 7 of them arrived"; seen with 8 devices on 2 cores, for the jax
loop and for Controller(serialize_execution=False) alike). This is why the Controller serializes
execution on CPU by default (serialize_execution; controller.py): its island schedulers launch a
computation only when the previous one has finished, which is what the blocking jax loop does
too, so both sides run the same way. The Controller is measured with that default. The
controller still never waits (its schedulers do), so OpByOp's `run` calls overlap execution.
--unserialized adds `Controller(serialize_execution=False)` ("pwtrain-async") and the
non-blocking jax loop ("jax Async"): only for machines where that does not deadlock.

Timing: for each size, the methods' blocks alternate (pwtrain OpByOp, Chained, Fused, jax
OpByOp, Fused, then again) --repeats times so that machine noise hits all alike; a block runs
one chain of K computations from its first dispatch until its result is ready. Reported:
computations/s = K / median block time; pwtrain / jax throughput per way (Chained vs the jax
loop) as the median over repeats of the ratio of the two blocks of the same repeat, which
cancels slow changes in machine load. "compute us" is jax Fused's time per computation: the
work without dispatch overhead (the paper's Fig. 6 axis), printed and on the plot's ticks
(--plot: throughput and ratio vs size). The crossover is the smallest size from which pwtrain
OpByOp (or Chained) stays within --tolerance of plain jax at every larger size measured; as the
ratios at large sizes are noisy on a shared machine, it is also predicted from pwtrain's extra
time per computation o (median over sizes): within tolerance once jax's own time per
computation t >= o (1 - tolerance) / tolerance (19 o for 5%). The final values of all ways are
checked against each other (bitwise for the chains).

Multi-tenancy: 2 islands of 4 devices shared by N clients (--clients), one thread each. Each
client asks the ResourceManager for 2 islands of 4 (so all clients share both) and runs
--mt_programs programs back to back, each a chain of 16 computations (the step above with psum
over the island's 4 devices): 8 on one island, a transfer, 8 on the other, and a transfer back;
clients alternate the direction (island0 -> island1 or back), each program continues its
client's chain. The controller's run-ahead bound never holds a client back. Blocks of 1, 2, 4
clients alternate. Reported: aggregate computations/s over all clients (median block), its ratio
to the first client count, and the slowest client's own rate (fairness). With serialized
execution the islands never compute at once, so sharing can only overlap one client's dispatch
with another's computation; the aggregate cannot exceed what one island-at-a-time can run.

Results (2 runs of the default command, jax 0.10.2, a 2-core VM shared with other jobs: load
average 8-11; plot of run 1: docs/bench_dispatch.png):
  n=0 (psum + add only, 140-210 us of work): jax OpByOp 2190-2810 computations/s; pwtrain
  OpByOp 0.79-0.82 of it, Chained 0.81-0.84; Fused 4700-7000/s on both sides (one dispatch).
  pwtrain's extra time per computation is about 70-100 us at every size (median over sizes),
  so it is within 5% of jax once jax takes >= 1.3-1.9 ms per computation: from n=192 (about
  2 ms of compute, 113 MFLOP over 8 devices) in both runs, where the measured ratios are
  0.95-1.0 at n=192 and 256 (one outlier, 1.14). At n=384 (about 9 ms) the paired ratios
  scatter from 0.80 to 1.07, noise: Fused, the same single dispatch on both sides, scatters
  as much (0.77-0.90), so the "measured" crossover is not reliable here; the predicted one is.
  Chained is no faster than OpByOp: with serialized execution the island's scheduler launches
  and waits for one computation at a time either way, and the caller's K `run` calls overlap
  that execution.
  Multi-tenancy: 2 and 4 clients together get 0.82-1.06 of one client's throughput (one
  client: 2460-2790/s at n=0, 1810-2210/s at n=64), shared fairly (the slowest of 4 clients
  gets 0.25 of the aggregate); no gain, as serialized execution runs one computation at a
  time over both islands.
"""

import argparse

import common

common.force_host_devices(8)

import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from pwtrain.backend import (  # noqa: E402
  Cluster,
  Controller,
  Node,
  Program,
  ResourceManager,
  Transfer,
)
from pwtrain.backend import controller as controller_lib  # noqa: E402

MT_NODES_PER_ISLAND = 8


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--num_computations", type=int, default=128, help="chain length K")
  p.add_argument("--sizes", default="0,16,32,64,96,128,192,256,384", help="per-device matmul n")
  p.add_argument("--repeats", type=int, default=9, help="timed blocks per method and size")
  p.add_argument("--tolerance", type=float, default=0.05, help="crossover: within this of jax")
  p.add_argument("--clients", default="1,2,4", help="multi-tenancy: client counts")
  p.add_argument("--mt_sizes", default="0,64", help="multi-tenancy: matmul n per computation")
  p.add_argument("--mt_programs", type=int, default=16, help="programs per client per block")
  p.add_argument(
    "--unserialized",
    action="store_true",
    help="also Controller(serialize_execution=False) and non-blocking jax (deadlocks on few cores)",
  )
  p.add_argument("--plot", default="/tmp/bench_dispatch.png")
  p.add_argument("--out", default="/tmp/bench_dispatch.json")
  args = p.parse_args(argv)
  args.sizes = [int(s) for s in args.sizes.split(",")]
  args.clients = [int(s) for s in args.clients.split(",")]
  args.mt_sizes = [int(s) for s in args.mt_sizes.split(",")]
  if min(args.num_computations, args.repeats, args.mt_programs, *args.clients) < 1:
    p.error("--num_computations, --repeats, --mt_programs and --clients must be >= 1")
  return args


def make_step(mesh, n: int):
  """One computation: optional n x n work per device, then a scalar all-reduce plus one."""
  num = mesh.shape["d"]

  def body(x, w):
    if n:  # depends on x, so XLA cannot hoist it out of a chain or a loop
      x = x + 1e-3 * jnp.mean(jnp.tanh(w * x) @ w)
    return jax.lax.psum(x, "d") / num + 1.0

  spec = PartitionSpec("d")
  return jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(), spec), out_specs=PartitionSpec())


def make_inputs(mesh, n: int):
  """The scalar start value (replicated) and each device's n x n block (rows sharded)."""
  rep, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
  m = max(n, 1)  # n == 0: the step ignores w (jit drops the unused argument)
  w = np.random.default_rng(n).standard_normal((mesh.shape["d"] * m, m)).astype(np.float32)
  return jax.device_put(np.float32(0.0), rep), jax.device_put(w / np.sqrt(m), rows), rep, rows


class Chains:
  """Every way of running one chain of K computations of size n; each returns the result."""

  def __init__(self, controller, island, n: int, k: int):
    mesh = island.mesh({"d": island.num_devices})
    self.k = k
    self.controller = controller
    self.x, self.w, rep, rows = make_inputs(mesh, n)
    step = make_step(mesh, n)

    def fused(x, w):
      return jax.lax.fori_loop(0, k, lambda _, y: step(y, w), x)

    shardings = {"in_shardings": (rep, rows), "out_shardings": rep}
    specs = (jax.ShapeDtypeStruct((), jnp.float32, sharding=rep), self.w)
    exe = controller.compile("step", step, island.name, specs, **shardings)
    fused_exe = controller.compile("fused", fused, island.name, specs, **shardings)
    self.one = Program((Node("step", exe, ("x", "w")),), {"x": ("step", 0)})
    nodes, ref = [], "x"
    for i in range(k):
      nodes.append(Node(f"step{i}", exe, (ref, "w")))
      ref = (f"step{i}", 0)
    self.chain = Program(tuple(nodes), {"x": ref})
    self.fused_program = Program((Node("fused", fused_exe, ("x", "w")),), {"x": ("fused", 0)})
    self.jit_step = jax.jit(step, **shardings)
    self.jit_fused = jax.jit(fused, **shardings)

  def pwtrain_opbyop(self, controller=None):
    controller = controller or self.controller
    x = self.x
    for _ in range(self.k):
      x = controller.run(self.one, {"x": x, "w": self.w})["x"]
    return self._finish(x, controller)

  def pwtrain_chained(self, controller=None):
    controller = controller or self.controller
    return self._finish(controller.run(self.chain, {"x": self.x, "w": self.w})["x"], controller)

  def pwtrain_fused(self):
    out = self.controller.run(self.fused_program, {"x": self.x, "w": self.w})["x"]
    return self._finish(out, self.controller)

  def jax_opbyop(self):
    x = self.x
    for _ in range(self.k):
      x = jax.block_until_ready(self.jit_step(x, self.w))
    return x

  def jax_async(self):
    x = self.x
    for _ in range(self.k):
      x = self.jit_step(x, self.w)
    return jax.block_until_ready(x)

  def jax_fused(self):
    return jax.block_until_ready(self.jit_fused(self.x, self.w))

  @staticmethod
  def _finish(future, controller):
    value = jax.block_until_ready(future.result())
    controller.wait()  # drains the run-ahead deque: all done already, so this is cheap
    return value


def timed(fn):
  start = time.perf_counter()
  value = fn()
  return time.perf_counter() - start, value


def sweep(args, cluster):
  """Throughput of every way, for every size; blocks of all methods alternate."""
  k = args.num_computations
  island = cluster.islands[0]
  rows = []
  controller = Controller(cluster, max_inflight=k)  # serialized: the CPU default
  unserialized = None
  if args.unserialized:
    unserialized = Controller(cluster, max_inflight=k, serialize_execution=False)
  for n in args.sizes:
    chains = Chains(controller, island, n, k)
    methods = {
      "pwtrain OpByOp": chains.pwtrain_opbyop,
      "pwtrain Chained": chains.pwtrain_chained,
      "pwtrain Fused": chains.pwtrain_fused,
      "jax OpByOp": chains.jax_opbyop,
      "jax Fused": chains.jax_fused,
    }
    if args.unserialized:
      methods["pwtrain-async OpByOp"] = lambda c=chains: c.pwtrain_opbyop(unserialized)
      methods["pwtrain-async Chained"] = lambda c=chains: c.pwtrain_chained(unserialized)
      methods["jax Async"] = chains.jax_async
    results = {name: fn() for name, fn in methods.items()}  # warm-up, compiles the jax side
    times = {name: [] for name in methods}
    for _ in range(args.repeats):
      for name, fn in methods.items():
        t, results[name] = timed(fn)
        times[name].append(t)
    values = {name: float(v) for name, v in results.items()}
    reference = values["jax OpByOp"]
    # The chains run the same executable K times: bitwise equal. A fused loop may round apart.
    for name, v in values.items():
      tolerance = 1e-4 * max(1.0, abs(reference)) if "Fused" in name else 0.0
      assert abs(v - reference) <= tolerance, (n, name, v, reference)
    if n == 0:
      assert reference == k, reference  # each step adds exactly 1
    median = {name: statistics.median(ts) for name, ts in times.items()}
    row = {
      "n": n,
      "flops": 2 * n**3 * island.num_devices,
      "compute_us": median["jax Fused"] / k * 1e6,
      "per_s": {name: k / t for name, t in median.items()},
      "blocks_s": times,
      "result": reference,
    }
    rows.append(row)
    print_row(row, first=len(rows) == 1)
  controller.close()
  if unserialized is not None:
    unserialized.close()
  return rows


def print_row(row, first: bool):
  names = list(row["per_s"])
  if first:
    print(f"{'n':>5}{'compute us':>12}" + "".join(f"{name:>22}" for name in names))
  line = f"{row['n']:>5}{row['compute_us']:>12.1f}"
  print(line + "".join(f"{row['per_s'][name]:>22.0f}" for name in names), flush=True)


PAIRS = {  # way -> (pwtrain method, the plain jax method it is compared with)
  "OpByOp": ("pwtrain OpByOp", "jax OpByOp"),
  "Chained": ("pwtrain Chained", "jax OpByOp"),
  "Fused": ("pwtrain Fused", "jax Fused"),
}


def ratios(row):
  """pwtrain / plain jax throughput per way: the median over repeats of jax time / pwtrain time
  of the same repeat (paired blocks run seconds apart, so slow drifts in load cancel)."""
  t = row["blocks_s"]
  return {
    way: statistics.median(b / a for a, b in zip(t[pw], t[jx], strict=True))
    for way, (pw, jx) in PAIRS.items()
  }


def overheads_us(row, k: int):
  """pwtrain's extra time per computation over plain jax, per way: median of paired blocks."""
  t = row["blocks_s"]
  return {
    way: statistics.median((a - b) / k * 1e6 for a, b in zip(t[pw], t[jx], strict=True))
    for way, (pw, jx) in PAIRS.items()
  }


def crossover(rows, way: str, tolerance: float):
  """The smallest size from which pwtrain `way` stays within `tolerance` of jax; or None."""
  found = None
  for row in reversed(rows):
    if ratios(row)[way] < 1.0 - tolerance:
      break
    found = row
  return found


def predicted_crossover(rows, way: str, tolerance: float, k: int):
  """The crossover implied by a constant per-computation overhead o: pwtrain is within
  `tolerance` once jax takes t >= o (1 - tolerance) / tolerance per computation. o is the
  median over sizes, robust where the ratios at large sizes drown in machine noise.

  Returns (o in us, t in us, the first size whose jax time per computation reaches t or None).
  """
  o = statistics.median(overheads_us(r, k)[way] for r in rows)
  t = max(o, 0.0) * (1.0 - tolerance) / tolerance
  jax_us = lambda r: 1e6 / r["per_s"][PAIRS[way][1]]
  return o, t, next((r for r in rows if jax_us(r) >= t), None)


def mt_program(tag, route, executables, shardings):
  """A chain of MT_NODES_PER_ISLAND steps on each island of `route`, with transfers between.

  The result goes back to the first island, where the client's next program starts. The nodes
  on island i read that island's n x n blocks as the program input `w_<i>`.
  """
  nodes, ref = [], "x"
  for j, island in enumerate(route):
    if j:
      nodes.append(Transfer(f"{tag}_to{j}", ref, island, shardings[island]))
      ref = (f"{tag}_to{j}", 0)
    for i in range(MT_NODES_PER_ISLAND):
      name = f"{tag}_{j}_{i}"
      nodes.append(Node(name, executables[island], (ref, f"w_{island}")))
      ref = (name, 0)
  nodes.append(Transfer(f"{tag}_back", ref, route[0], shardings[route[0]]))
  return Program(tuple(nodes), {"x": (f"{tag}_back", 0)})


def mt_block(controller, cluster, islands, num_clients: int, num_programs: int, n: int):
  """One timed block: `num_clients` threads each run a chain of `num_programs` programs.

  `islands` maps island name -> (step executable, start value, w, replicated sharding).
  Returns (wall time of the block, the slowest client's computations/s).
  """
  rm = ResourceManager(cluster)
  programs = []
  for c in range(num_clients):
    route = [i.name for i in rm.allocate(f"client{c}", 2, 4)]  # all clients share both
    route = route if c % 2 == 0 else route[::-1]
    executables = {name: islands[name][0] for name in route}
    shardings = {name: islands[name][3] for name in route}
    programs.append((mt_program(f"c{c}", route, executables, shardings), route[0]))
  feed = {f"w_{name}": w for name, (_, _, w, _) in islands.items()}
  per_client = num_programs * MT_NODES_PER_ISLAND * 2
  done, finals, errors = [0.0] * num_clients, [None] * num_clients, []

  def client(c):
    try:
      program, first = programs[c]
      x = islands[first][1]
      for _ in range(num_programs):  # each program continues the client's chain
        x = controller.run(program, {"x": x, **feed})["x"]
      finals[c] = jax.block_until_ready(x.result())
      done[c] = time.perf_counter() - start
    except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
      errors.append(e)

  threads = [threading.Thread(target=client, args=(c,)) for c in range(num_clients)]
  start = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  elapsed = time.perf_counter() - start
  controller.wait()
  if errors:
    raise errors[0]
  if n == 0:  # every step adds exactly 1 to the start value 0
    assert all(float(v) == per_client for v in finals), [float(v) for v in finals]
  return elapsed, min(per_client / d for d in done)


def multitenancy(args, devices):
  """Aggregate throughput of N clients sharing 2 islands of 4 devices, vs one client."""
  cluster = Cluster.local([4, 4], devices=devices)
  # Never waits inside a block: every client may have all its programs in flight.
  controller = Controller(cluster, max_inflight=max(args.clients) * args.mt_programs)
  per_client = args.mt_programs * MT_NODES_PER_ISLAND * 2  # computations per client per block
  rows = []
  for n in args.mt_sizes:
    islands = {}  # name -> (executable, start value, w, replicated sharding)
    for island in cluster.islands:
      mesh = island.mesh({"d": island.num_devices})
      x, w, rep, row_sharding = make_inputs(mesh, n)
      specs = (jax.ShapeDtypeStruct((), jnp.float32, sharding=rep), w)
      step = make_step(mesh, n)
      shardings = {"in_shardings": (rep, row_sharding), "out_shardings": rep}
      islands[island.name] = (controller.compile("step", step, island.name, specs, **shardings),)
      islands[island.name] += (x, w, rep)

    block = lambda c, n=n, i=islands: mt_block(controller, cluster, i, c, args.mt_programs, n)
    block(max(args.clients))  # warm-up
    times = {c: [] for c in args.clients}
    slowest = {c: [] for c in args.clients}
    for _ in range(args.repeats):
      for c in args.clients:
        elapsed, slow = block(c)
        times[c].append(elapsed)
        slowest[c].append(slow)
    aggregate = {c: c * per_client / statistics.median(times[c]) for c in args.clients}
    base = aggregate[args.clients[0]]
    for c in args.clients:
      rows.append(
        {
          "n": n,
          "clients": c,
          "aggregate_per_s": aggregate[c],
          "vs_first": aggregate[c] / base,
          "slowest_client_per_s": statistics.median(slowest[c]),
          "blocks_s": times[c],
        }
      )
      print(
        f"{n:>5}{c:>9}{aggregate[c]:>16.0f}{aggregate[c] / base:>10.2f}"
        f"{statistics.median(slowest[c]):>16.0f}",
        flush=True,
      )
  controller.close()
  return rows


def plot(rows, path: str, k: int, tolerance: float):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  # One point per size, in order; the measured compute time is too noisy near zero to be a
  # monotonic axis, so it labels the ticks with n.
  x = range(len(rows))
  labels = [f"{r['n']}\n{r['compute_us']:.0f}" for r in rows]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7), sharex=True, height_ratios=(2, 1))
  styles = {"pwtrain": "-", "pwtrain-async": "-.", "jax": "--"}
  for name in rows[0]["per_s"]:
    system = name.split()[0]
    top.plot(x, [r["per_s"][name] for r in rows], styles[system], marker="o", label=name)
  top.set_yscale("log")
  top.set_ylabel("computations / s (median of blocks)")
  top.set_title(f"Chains of {k} gang-scheduled (psum + add) computations, 8 CPU devices")
  top.legend(fontsize=8)
  top.grid(True, which="both", alpha=0.3)
  for way in PAIRS:
    bottom.plot(x, [ratios(r)[way] for r in rows], marker="o", label=f"pwtrain / jax {way}")
  bottom.axhline(1.0 - tolerance, color="gray", linestyle=":", label=f"{1 - tolerance:.2f}")
  bottom.set_xticks(list(x), labels, fontsize=8)
  bottom.set_xlabel("matmul n per device / compute per computation, us (jax Fused time / K)")
  bottom.set_ylabel("throughput ratio (paired)")
  bottom.legend(fontsize=8)
  bottom.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  load = common.Load()
  devices = jax.devices()
  assert len(devices) == 8, devices
  k = args.num_computations
  print(
    f"devices=8 ({devices[0].platform}), one island of 8, K={k} computations per chain, "
    f"repeats={args.repeats}; Controller: serialize_execution=True (the CPU default), "
    f"max_inflight={k}"
  )
  print("computations/s (K / median block time):")
  rows = sweep(args, Cluster.local(1, devices=devices))

  print()
  print("pwtrain / jax throughput and pwtrain's extra us per computation (medians of paired")
  print("blocks; Chained vs the jax loop):")
  print(
    f"{'n':>5}{'compute us':>12}{'OpByOp':>10}{'Chained':>10}{'Fused':>10}"
    f"{'OpByOp +us':>12}{'Chained +us':>13}"
  )
  for r in rows:
    q, o = ratios(r), overheads_us(r, k)
    print(
      f"{r['n']:>5}{r['compute_us']:>12.1f}{q['OpByOp']:>10.3f}{q['Chained']:>10.3f}"
      f"{q['Fused']:>10.3f}{o['OpByOp']:>12.0f}{o['Chained']:>13.0f}"
    )
  cross = {}
  tol = args.tolerance
  for way in ("OpByOp", "Chained"):
    row = crossover(rows, way, tol)
    o, t, predicted = predicted_crossover(rows, way, tol, k)
    cross[way] = {
      "measured_n": None if row is None else row["n"],
      "overhead_us": o,
      "jax_us_needed": t,
      "predicted_n": None if predicted is None else predicted["n"],
    }
    if row is None:
      measured = f"not within {tol:.0%} of jax at the largest size"
    else:
      measured = (
        f"within {tol:.0%} of jax from n={row['n']} ({row['compute_us']:.0f} us of compute per "
        f"computation, {row['flops'] / 1e6:.1f} MFLOP over 8 devices)"
      )
    print(f"crossover {way}: measured: pwtrain {measured}")
    print(
      f"  predicted from the overhead ({o:.0f} us per computation, median over sizes): "
      f"within {tol:.0%} once jax takes >= {t:.0f} us per computation,"
    )
    print("  " + ("beyond the sizes measured" if predicted is None else f"from n={predicted['n']}"))

  print()
  print(
    f"multi-tenancy: 2 islands x 4 devices shared by N clients, {args.mt_programs} programs of "
    f"{2 * MT_NODES_PER_ISLAND} computations per client"
  )
  print(f"{'n':>5}{'clients':>9}{'aggregate /s':>16}{'vs 1':>10}{'slowest /s':>16}")
  mt_rows = multitenancy(args, devices)

  plot(rows, args.plot, k, args.tolerance)
  print(f"wrote {args.plot}")
  result = {
    **common.machine(),
    **load.report(),
    "controller_sha256": common.source_sha256(controller_lib),
    "num_computations": k,
    "repeats": args.repeats,
    "serialize_execution": True,
    "unserialized_measured": args.unserialized,
    "sweep": rows,
    "crossover": cross,
    "tolerance": args.tolerance,
    "multitenancy": mt_rows,
  }
  common.write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
