"""GRPO on the live model (pwtrain/rl/, docs/rl.md): how the toy task learns, what weight sync
costs (nothing, against a generator with its own copy), the memory of one copy against two, the
generator/trainer log-prob mismatch in float32 and bfloat16, and the time split of a step.

  python experiments/bench_rl.py                          # every section
  python experiments/bench_rl.py --sections=learning --seeds=0,1,2 --steps=150

curves     the learning section's figures from runs already made (--workdirs), finished or not.
learning   configs/grpo_toy (the "shift" task from random initialisation; any --set) for --steps
           steps with each of --seeds: the 10-step mean reward against steps and seconds (the
           steps' generation, reward and training seconds summed; the first step's compile
           apart), the first step at which it reaches 0.5 and 0.9, and the last 10 steps' mean.
sync       grpo_toy on an island of 4 of the 8 simulated devices for --sync_steps steps: the
           time from the end of each update to the first rollout token that uses it
           (first_token_s) and the bytes copied for it (0: the engine reads the published
           state in place). Side by side in the same process, the usual two-copy path: the
           trained params copied to a generator's own copy on the other 4 devices
           (jax.device_put, blocked on) and through a checkpoint (Orbax save and restore of the
           params in a temporary directory), each timed --repeats times (median), with the
           bytes moved; a two-copy generator's first token follows its copy, so its time from
           update to first token is the copy plus the same first_token_s.
memory     device bytes of an RL run's state (params, optimizer state, the reference of
           rl.kl_coef > 0) and the engine's KV caches, against the two-copy layout (plus the
           generator's copy of the params).
mismatch   --mismatch_steps steps of grpo_toy with model.dtype float32 and bfloat16 (params in
           float32): the largest and mean |sampler log-prob - trainer log-prob| over the
           completion tokens (the step's logprob_mismatch_max/_mean), over the steps.
split      from the learning runs: generation, reward and training seconds per step (medians,
           the first step apart) at the runs' rl.max_staleness (--set rl.max_staleness=1: step
           N+1's rollouts made while step N trains, train_s then 0 as the loop does not wait).
           On a CPU the controller runs one computation at a time, so only the host's work
           overlaps the device's, not the rollouts' programs with the step's.
mismatch peak: experiments/rl_mismatch.py (where the float32 mismatch peaks, and why).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.force_host_devices(8)


def _run(args, overrides: dict, workdir: str):
  from pwtrain import train

  config = common.load_config(args.config, overrides)
  start = time.perf_counter()
  result = train.run(config, workdir, show_progress=False)
  rows = [r for r in result.history if "reward_mean" in r]
  return rows, time.perf_counter() - start, result


def _step_s(row: dict) -> float:
  return row["generation_s"] + row["reward_s"] + row["train_s"]


def learning(args, sets: dict) -> dict:
  out = {}
  for seed in args.seeds:
    workdir = os.path.join(args.workdir, f"seed{seed}")
    _, wall, _ = _run(args, {**sets, "seed": seed, "train.num_steps": args.steps}, workdir)
    out[f"seed{seed}"] = _curve(workdir, wall)
    print(seed, out[f"seed{seed}"], flush=True)
  reached = sum(v["first_mean_0.9"] is not None for v in out.values())
  out["seeds_reaching_0.9"] = f"{reached} of {len(args.seeds)}"
  return out


def curves(args, sets: dict) -> dict:
  """The learning section's figures from the metrics.jsonl of runs already made (--workdirs:
  runs of grpo_toy, finished or still running), e.g. seeds run as separate processes."""
  return {os.path.basename(w.rstrip("/")): _curve(w, None) for w in args.workdirs.split(",")}


def _curve(workdir: str, wall) -> dict:
  """A run's 10-step mean reward against steps and seconds (its metrics.jsonl)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "reward_mean" in r]
  rewards = [r["reward_mean"] for r in rows]
  seconds, clock = [], 0.0
  for i, r in enumerate(rows):
    clock += _step_s(r) if i else 0.0  # the first step's compile apart
    seconds.append(clock)
  means = [statistics.fmean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
  reached = {
    x: next(({"step": rows[i]["step"], "seconds": round(seconds[i], 1)}
              for i, m in enumerate(means) if i >= 9 and m >= x), None)
    for x in (0.5, 0.9)
  }  # fmt: skip
  curve = {rows[i]["step"]: [round(means[i], 3), round(seconds[i], 1)]
           for i in range(9, len(rows), 10)}  # fmt: skip
  return {
    "steps": len(rows),
    "first_mean_0.5": reached[0.5],
    "first_mean_0.9": reached[0.9],
    "last_10_mean": round(means[-1], 3),
    "first_reward": round(rewards[0], 3),
    "curve_step_mean_seconds": curve,
    "wall_s": None if wall is None else round(wall, 1),
    "split_median_s": {
      k: round(statistics.median(r[k] for r in rows[1:]), 4)
      for k in ("generation_s", "reward_s", "train_s", "first_token_s")
      if all(k in r for r in rows)
    },
  }


def _tree_bytes(tree) -> int:
  import jax

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def sync(args, sets: dict) -> dict:
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  overrides = {**sets, "parallel.devices_per_island": 4, "train.num_steps": args.sync_steps}
  with tempfile.TemporaryDirectory() as workdir:
    rows, _, result = _run(args, overrides, workdir)
  first_token = statistics.median(r["first_token_s"] for r in rows[1:])
  params = result.state["params"]
  nbytes = _tree_bytes(params)
  other = jax.devices()[4:]
  target = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.asarray(other), ("d",)), jax.sharding.PartitionSpec()
  )
  copies = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(params, target))
    copies.append(time.perf_counter() - start)
  saves = []
  with tempfile.TemporaryDirectory() as directory:
    checkpointer = ocp.StandardCheckpointer()
    for i in range(args.repeats):
      path = os.path.join(directory, str(i))
      start = time.perf_counter()
      checkpointer.save(path, params)
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, params))
      jax.block_until_ready(restored)
      saves.append(time.perf_counter() - start)
      written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    checkpointer.close()
  device_put, checkpoint = statistics.median(copies), statistics.median(saves)
  return {
    "in_place": {"sync_s": 0.0, "bytes": 0, "update_to_first_token_s": round(first_token, 4)},
    "device_put": {
      "sync_s": round(device_put, 4),
      "bytes": nbytes * len(other),  # the whole params to each of the generator's devices
      "update_to_first_token_s": round(device_put + first_token, 4),
    },
    "checkpoint": {
      "sync_s": round(checkpoint, 4),
      "bytes": written,
      "update_to_first_token_s": round(checkpoint + first_token, 4),
    },
    "param_bytes": nbytes,
  }


def memory(args, sets: dict) -> dict:
  from pwtrain import rl
  from pwtrain.harness import Harness

  config = common.load_config(args.config, {**sets, "rl.kl_coef": 0.05})
  with tempfile.TemporaryDirectory() as workdir, Harness.build(config) as harness:
    state = harness.step_program.init()
    whole = harness.step_program.to_checkpoint(state)
    batches = rl.rollout_batches(config, workdir)
    with rl.running(batches, harness, state, 0):
      next(batches)
      caches = batches.engine.status()["cache_bytes"]
  parts = {k: _tree_bytes(whole[k]) for k in ("params", "opt_state", "reference") if k in whole}
  one = sum(parts.values()) + caches
  return {
    **{f"{k}_bytes": v for k, v in parts.items()},
    "kv_cache_bytes": caches,
    "one_copy_bytes": one,
    "two_copy_bytes": one + parts["params"],
    "note": "reference held only with rl.kl_coef > 0 (here 0.05); activations not counted",
  }


def mismatch(args, sets: dict) -> dict:
  out = {}
  for dtype in ("float32", "bfloat16"):
    with tempfile.TemporaryDirectory() as workdir:
      rows, _, _ = _run(
        args, {**sets, "model.dtype": dtype, "train.num_steps": args.mismatch_steps}, workdir
      )
    out[dtype] = {
      "max": max(r["logprob_mismatch_max"] for r in rows),
      "mean": statistics.fmean(r["logprob_mismatch_mean"] for r in rows),
      "steps": len(rows),
    }
    print(dtype, out[dtype], flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sections", default="learning,sync,memory,mismatch")
  parser.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--sync_steps", type=int, default=10)
  parser.add_argument("--mismatch_steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="", help="write the results as JSON here")
  parser.add_argument("--workdir", default="/tmp/bench_rl", help="learning: seed<N>/ runs here")
  parser.add_argument("--workdirs", default="", help="curves: runs' workdirs, comma-separated")
  common.add_config_args(parser, default="grpo_toy")
  args = parser.parse_args()
  sets = common.parse_sets(args.set)
  results = {"machine": common.machine(), "sets": sets}
  for section in args.sections.split(","):
    results[section] = globals()[section](args, sets)
    print(section, results[section], flush=True)
  if "learning" in results:
    results["split"] = {k: v["split_median_s"] for k, v in results["learning"].items()
                        if isinstance(v, dict)}  # fmt: skip
  if args.out:
    common.write_json(args.out, results)


if __name__ == "__main__":
  main()
