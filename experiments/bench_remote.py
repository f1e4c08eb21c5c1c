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

import common

common.force_host_devices(8)

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pwtrain.backend import Cluster  # noqa: E402
from pwtrain.backend.remote import arrays, launcher, saves  # noqa: E402
from pwtrain.backend.remote import protocol_pb2 as pb  # noqa: E402
from pwtrain.backend.remote.values import fetch_value  # noqa: E402
from pwtrain.checkpoint import Checkpointer  # noqa: E402
from pwtrain.harness import Harness  # noqa: E402

TEST_MODEL = {  # the tests' model (tests/helpers.py TINY)
  "model.num_layers": 2,
  "model.d_model": 64,
  "model.num_heads": 8,
  "model.head_dim": 8,
  "model.d_ff": 128,
  "data.seq_len": 32,
  "train.global_batch": 16,
}
LAYOUTS = {
  "pods": {"parallel.pods": 2, "parallel.islands": 2},
  "pipeline": {"parallel.stages": 2, "parallel.islands": 2, "train.num_microbatches": 2},
}


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
      ckpt.save(r + 1, side.step_program.to_checkpoint(state()), {"repeat": r})
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

  config = common.load_config("palm_tiny", {**TEST_MODEL, **LAYOUTS[args.layout]})
  batches = common.random_batches(config, args.steps)
  results = {"layout": args.layout, "steps_per_block": args.steps}
  with launcher.launch([2, 2]) as workers:
    # Timed until the metrics are on the host: waiting for the remote state would fetch it.
    embedded = common.Side(Harness.build(config, jax.devices()[:4]), batches, time_state=False)
    cluster = Cluster.connect(workers.addresses, workers.token, devices=jax.devices()[:2])
    remote_side = common.Side(Harness.build(config, cluster=cluster), batches, time_state=False)
    sides = {"embedded": embedded, "remote": remote_side}
    for side in sides.values():
      side.run(2)  # warm up
    blocks = {name: [] for name in sides}
    for _ in range(args.repeats):
      for name, side in sides.items():
        blocks[name].append(side.run(len(batches)))
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
    common.write_json(args.out, results)


if __name__ == "__main__":
  main()
