"""Remote islands vs embedded: step time of the same config, and transfer throughput over
loopback, in one run.

Run (8 simulated CPU devices for the embedded side; about 2 minutes on 2 cores):
  python experiments/bench_remote.py
  python experiments/bench_remote.py --layout=pods --steps=10 --repeats=3 --mib=64

1. Step time. palm_tiny cut to 2 layers, d_model 64, seq 32, global batch 16 (the test model)
   as a 2-stage 1F1B pipeline (--layout=pipeline, 2 microbatches) or 2 data-parallel pods
   (--layout=pods) on 2 islands of 2 devices: embedded (one process) and remote (one worker
   process per island, started by the launcher on 127.0.0.1). Steps go through the Controller as
   pwtrain.train drives them, on pre-generated batches; a block of --steps steps is timed from
   its first dispatch until its last metrics are on the host; blocks alternate between the two
   modes --repeats times and the median block is reported as ms/step.
2. Transfer throughput. A --mib MiB float32 array is uploaded from the controller to worker 0
   (Put, chunked), pulled worker 0 -> worker 1 (Receive: worker-to-worker, not through the
   controller) and fetched back to the controller (Fetch); each timed --repeats times, median.
   The pull is timed as (pull + fetch of its result) - (a fetch of the same size).
3. Checkpoint. The state after the timed blocks is saved --repeats times (async Orbax, to a temp
   directory): embedded (the controller's Orbax save of its own devices' arrays); remote (each
   worker writes its island's part, the controller commits once all have: two-phase); and
   remote_via_controller (fetch the state to the controller, then save it as embedded mode does:
   what remote mode did before worker-side saves). Reported: the median time the train loop is
   held by `save` (hand_off_ms) and until the step is committed (commit_ms).
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import random_batches, tiny_test_config  # noqa: E402

from pwtrain import optim  # noqa: E402
from pwtrain.backend import Cluster, Controller  # noqa: E402
from pwtrain.backend.remote import arrays, launcher, saves  # noqa: E402
from pwtrain.backend.remote import protocol_pb2 as pb  # noqa: E402
from pwtrain.backend.remote.dispatch import fetch_value  # noqa: E402
from pwtrain.checkpoint import Checkpointer  # noqa: E402
from pwtrain.parallel import build_step_program  # noqa: E402
from pwtrain.parallel import plan as plan_lib  # noqa: E402


def layout_config(layout):
  if layout == "pods":
    return tiny_test_config(**{"parallel.pods": 2, "parallel.islands": 2})
  return tiny_test_config(
    **{"parallel.stages": 2, "parallel.islands": 2, "train.num_microbatches": 2}
  )


class Side:
  """A compiled step on a cluster, with its state, ready to time."""

  def __init__(self, config, cluster):
    self.cluster = cluster
    self.controller = Controller(cluster, max_inflight=config.backend.max_inflight_steps)
    tx, schedule = optim.build(config.optim, config.train.num_steps)
    self.program = build_step_program(
      config, plan_lib.build(config, cluster), self.controller, tx, schedule
    )
    self.state = self.program.init()
    self.step = 0

  def block(self, batches) -> float:
    start = time.perf_counter()
    out = None
    for batch in batches:
      out = self.controller.run(
        self.program.program_for(self.step), {**self.state, **self.program.feed(batch)}
      )
      self.state = {k: out[k] for k in self.program.state_keys}
      self.step += 1
    jax.block_until_ready(out["metrics"].result())
    return (time.perf_counter() - start) / len(batches)

  def close(self):
    self.controller.wait()
    self.controller.close()


def transfer_throughput(cluster, mib, repeats):
  w0, w1 = (i.worker for i in cluster.islands)
  x = np.random.default_rng(0).standard_normal(mib * (1 << 18)).astype(np.float32)
  mesh = cluster.islands[1].mesh({"x": 2})
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  times = {"put": [], "worker_to_worker": [], "fetch": []}
  for r in range(repeats):
    t = time.perf_counter()
    w0.put_async(f"bench{r}", [x], uses=0).result()
    times["put"].append(time.perf_counter() - t)
    receive = pb.Receive(
      source=w0.address,
      handle=f"bench{r}",
      output=pb.Output(handle=f"bench{r}b", uses=0),
      shardings=[arrays.sharding_to_proto(whole)],
    )
    t = time.perf_counter()
    w1.enqueue_async([pb.Op(name="t", receive=receive)]).result()
    w1.fetch(f"bench{r}b", release=True)  # returns once the pull has landed, plus a fetch
    both = time.perf_counter() - t
    t = time.perf_counter()
    w0.fetch(f"bench{r}", release=True)
    times["fetch"].append(time.perf_counter() - t)
    # The pull is timed with a fetch of its result; the fetch of the same bytes is subtracted.
    times["worker_to_worker"].append(max(both - times["fetch"][-1], 1e-9))
  return {k: mib / statistics.median(v) for k, v in times.items()}


def checkpoint_times(side, how, repeats) -> dict:
  """Median ms (hand-off, commit) of saving `side`'s current state `how`."""

  def state():
    if how == "workers":
      return {k: saves.leaf_refs(v) for k, v in side.state.items()}
    if how == "via_controller":  # a fresh fetch per save (RemoteValue.result() would cache it)
      return {k: fetch_value(v.ref) for k, v in side.state.items()}
    return {k: v.result() if hasattr(v, "result") else v for k, v in side.state.items()}

  hand_off, commit = [], []
  with tempfile.TemporaryDirectory() as directory:
    ckpt = Checkpointer(directory, keep=2, every=1, part_writer=saves.PendingSave)
    for r in range(repeats):
      start = time.perf_counter()
      ckpt.save(r + 1, side.program.to_checkpoint(state()), {"repeat": r})
      hand_off.append(time.perf_counter() - start)
      ckpt.wait()
      commit.append(time.perf_counter() - start)
    ckpt.close()
  return {
    "hand_off_ms": 1e3 * statistics.median(hand_off),
    "commit_ms": 1e3 * statistics.median(commit),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layout", choices=("pipeline", "pods"), default="pipeline")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--mib", type=int, default=64)
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  config = layout_config(args.layout)
  batches = random_batches(config, args.steps)
  results = {"layout": args.layout, "steps_per_block": args.steps}
  with launcher.launch([2, 2]) as workers:
    embedded = Side(config, plan_lib.make_cluster(config, devices=jax.devices()[:4]))
    cluster = Cluster.connect(workers.addresses, workers.token, devices=jax.devices()[:2])
    remote_side = Side(config, cluster)
    sides = {"embedded": embedded, "remote": remote_side}
    for side in sides.values():
      side.block(batches[:2])  # warm up
    blocks = {name: [] for name in sides}
    for _ in range(args.repeats):
      for name, side in sides.items():
        blocks[name].append(side.block(batches))
    for name in sides:
      results[f"{name}_ms_per_step"] = 1e3 * statistics.median(blocks[name])
    for name, side, how in (
      ("embedded", embedded, "local"),
      ("remote", remote_side, "workers"),
      ("remote_via_controller", remote_side, "via_controller"),
    ):
      for key, value in checkpoint_times(side, how, args.repeats).items():
        results[f"ckpt_{name}_{key}"] = value
    for side in sides.values():
      side.close()
    results["remote_over_embedded"] = (
      results["remote_ms_per_step"] / results["embedded_ms_per_step"]
    )
    results.update(
      {f"{k}_MiB_per_s": v for k, v in transfer_throughput(cluster, args.mib, args.repeats).items()}
    )
    cluster.close()
  for key, value in results.items():
    print(f"{key:>40}: {value:.2f}" if isinstance(value, float) else f"{key:>40}: {value}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
