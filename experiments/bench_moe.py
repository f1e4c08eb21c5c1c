"""Mixture of Experts: step time of MoE vs a dense model with the same active FLOPs on 8
simulated CPU devices (capacity-based vs dropless routing), and a training comparison.

Run (timings, then dense and palm_tiny_moe trained 300 steps side by side; ~15 minutes on 2 cores):
  python experiments/bench_moe.py
  python experiments/bench_moe.py --train_steps=0 --repeats=5      # timings only
  # training only: 4 experts of 256 (top-2) in every layer vs dense, 500 steps, 3 seeds
  python experiments/bench_moe.py --repeats=0 --train_steps=500 --seeds=0,1,2 \
      --variants=dense,e4k2_every1_cap2
Options: --steps (per timed block), --repeats (timed blocks per side; 0: no timings),
--train_steps (0: no training), --seeds, --variants (dense first; TRAIN_VARIANTS below),
--moe_overrides (key=value,... on every MoE variant), --last (steps averaged), --jobs (training
runs at a time), --out (JSON of every number, with each run's ce_loss per step).

Sides (all palm_tiny shapes: 4 layers, d_model 128, 16 x 128 tokens per step):
  dense              configs/palm_tiny.py, d_ff 512, data parallel over 8 devices
  moe_ep8            configs/palm_tiny_moe.py: layers 1 and 3 have 8 experts of d_ff 256, top-2,
                     so a token's active FFN FLOPs equal dense's; one expert per device
                     (parallel.expert=8): tokens go to their experts all-to-all; capacity 1.25
  moe_ep8_dropless   the same, moe.dropless=True (sorted tokens, ragged_dot; no capacity)
  moe_dp8            the same MoE model with every expert on every device (parallel.expert=1,
                     data=8): no all-to-all, each device runs all experts on its own tokens
  moe_dp8_dropless   that, dropless
Timing: each side is one compiled step driven through the Controller as pwtrain.train drives it;
blocks of --steps steps alternate between the sides (dense, moe_ep8, ..., dense, ...) so that
machine noise hits all alike; the table has each side's median ms per step over its blocks.

Training: pwtrain.train.run for --train_steps steps of the built-in corpus, each variant and seed
in its own process on one CPU device (the fastest way to train this model here; the layout
changes no number), --jobs at a time. A seed sets both the data order and the initialisation,
so a variant and dense with the same seed see the same batches. Compared on ce_loss (an MoE
run's `loss` also holds its weighted aux losses): the last step, the mean of the last --last
steps, and that mean minus dense's (delta; also at each quarter of the run, d@t). The corpus is
read once without repetition within about 3400 steps, so the training ce_loss is a held-out loss.

Caveat: simulated CPU devices share 2 cores; XLA's CPU all-to-all and the ragged_dot fallback
are not what a TPU/GPU does. The timings say what each layout costs here, not on accelerators.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common

# The timing sides run on 8 simulated devices; each training run is a child process
# (--_train_one) on one device, the fastest way to train this model on a CPU.
common.force_host_devices(1 if "--_train_one" in sys.argv else 8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pwtrain import train  # noqa: E402
from pwtrain.data import corpus  # noqa: E402
from pwtrain.harness import Harness  # noqa: E402
from pwtrain.models import arithmetic  # noqa: E402

SIDES = {
  "dense": ("palm_tiny", {}),
  "moe_ep8": ("palm_tiny_moe", {}),
  "moe_ep8_dropless": ("palm_tiny_moe", {"moe.dropless": True}),
  "moe_dp8": ("palm_tiny_moe", {"parallel.expert": 1, "parallel.data": 8}),
  "moe_dp8_dropless": (
    "palm_tiny_moe",
    {"parallel.expert": 1, "parallel.data": 8, "moe.dropless": True},
  ),
}


# Training variants (config, overrides), each trained on one device (parallel.expert=1): the
# experts' placement changes no number (tests/test_moe.py), only the speed. Every MoE variant has
# top_k x expert d_ff = 512 = palm_tiny's d_ff (moe.d_ff=0 resolves to model.d_ff // top_k): the
# same active FFN parameters and FLOPs per token. "moe" is configs/palm_tiny_moe.py as it stands;
# the others set every MoE key they depend on, so they do not change when the config does.
def _moe(experts, top_k, every, capacity, dropless=False):
  return (
    "palm_tiny_moe",
    {
      "moe.num_experts": experts,
      "moe.top_k": top_k,
      "moe.d_ff": 0,
      "moe.every": every,
      "moe.capacity_factor": capacity,
      "moe.dropless": dropless,
    },
  )


TRAIN_VARIANTS = {
  "dense": ("palm_tiny", {}),
  "moe": ("palm_tiny_moe", {}),
  "e8k2_every2_cap1.25": _moe(8, 2, 2, 1.25),  # the first palm_tiny_moe
  "e8k2_every2_cap2": _moe(8, 2, 2, 2.0),
  "e8k2_every1_cap1.25": _moe(8, 2, 1, 1.25),
  "e8k2_every1_cap2": _moe(8, 2, 1, 2.0),
  "e8k2_every1_dropless": _moe(8, 2, 1, 2.0, dropless=True),
  "e8k1_every1_cap2": _moe(8, 1, 1, 2.0),  # Switch: 8 experts of 512
  "e8k4_every1_cap2": _moe(8, 4, 1, 2.0),  # 8 experts of 128; capacity 2 = no drops
  "e4k2_every1_cap2": _moe(4, 2, 1, 2.0),  # 4 experts of 256; capacity 2 = no drops
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=5, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=5, help="timed blocks per side")
  p.add_argument("--train_steps", type=int, default=300, help="0: skip the training comparison")
  p.add_argument("--seeds", default="0", help="comma-separated seeds (data order and init)")
  p.add_argument(
    "--variants",
    default="dense,moe",
    help=f"comma-separated training variants; dense first. Known: {', '.join(TRAIN_VARIANTS)}",
  )
  p.add_argument(
    "--moe_overrides",
    default="",
    help="key=value,... applied to every MoE variant, e.g. moe.capacity_factor=1.25,moe.every=2",
  )
  p.add_argument("--last", type=int, default=50, help="ce_loss averaged over the last N steps")
  p.add_argument("--jobs", type=int, default=2, help="training runs at a time (one core each)")
  p.add_argument("--out", default="/tmp/bench_moe.json")
  p.add_argument(
    "--_train_one", nargs=3, metavar=("VARIANT", "SEED", "OUT"), help=argparse.SUPPRESS
  )
  p.add_argument("--_data_dir", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def parse_overrides(text: str) -> dict:
  """'moe.every=2,moe.capacity_factor=1.25' -> {'moe.every': 2, 'moe.capacity_factor': 1.25}."""
  return common.parse_sets([item for item in text.split(",") if item])


def time_sides(args) -> dict:
  sides = {}
  for name, (config_name, overrides) in SIDES.items():
    config = common.load_config(config_name, overrides)
    # Byte tokens, as the corpus has: below 258.
    sides[name] = common.Side(Harness.build(config), common.random_batches(config, 8, high=258))
    sides[name].run(1)  # warm-up: first dispatch, allocator
    print(f"compiled {name} in {sides[name].harness.compile_s:.1f} s", file=sys.stderr)
  times = {name: [] for name in sides}
  for _ in range(args.repeats):
    for name, side in sides.items():
      times[name].append(side.run(args.steps))
  rows = {}
  for name, side in sides.items():
    m = jax.device_get(side.last_metrics.result())
    rows[name] = {
      "ms_per_step": 1e3 * statistics.median(times[name]),
      "blocks_ms": [1e3 * t for t in times[name]],
      "compile_s": side.harness.compile_s,
      "dropped_fraction": float(m.get("moe_dropped_fraction", 0.0)),
    }
    side.close()
  return rows


def train_config(variant: str, seed: int, steps: int, moe_overrides: dict, data_dir=None):
  name, overrides = TRAIN_VARIANTS[variant]
  overrides = {
    **overrides,
    "seed": seed,
    "train.num_steps": steps,
    "train.checkpoint_every": steps,
    "train.log_every": 100,
  }
  if name != "palm_tiny":
    overrides.update({"parallel.expert": 1, "parallel.data": -1, **moe_overrides})
  if data_dir:
    overrides["data.data_dir"] = data_dir
  return common.load_config(name, overrides)


def train_one(args) -> None:
  """Child process (one device): trains one variant and seed, writes its ce_loss per step."""
  variant, seed, out_path = args._train_one
  config = train_config(
    variant, int(seed), args.train_steps, parse_overrides(args.moe_overrides), args._data_dir
  )
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    result = train.run(config, workdir, show_progress=False)
    wall = time.perf_counter() - start
  last = result.history[-1]
  row = {
    "variant": variant,
    "seed": int(seed),
    "moe": config.moe.to_dict() if config.moe.num_experts else None,
    "ce": [r["ce_loss"] for r in result.history],
    "wall_s": wall,
    "params": arithmetic.param_count(config.model, config.moe),
    "active_params": arithmetic.param_count(config.model, config.moe, active=True),
  }
  row.update(
    {k: last[k] for k in ("moe_aux_loss", "moe_dropped_fraction", "moe_load_max") if k in last}
  )
  if "moe_dropped_fraction" in last:
    row["dropped_mean"] = float(np.mean([r["moe_dropped_fraction"] for r in result.history]))
  with open(out_path, "w") as f:
    json.dump(row, f)


def train_compare(args) -> dict:
  """Every variant x seed as a child process, --jobs at a time; -> {"variant/seed": row}."""
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in TRAIN_VARIANTS]
  if unknown:
    raise SystemExit(f"unknown --variants {unknown}; known: {', '.join(TRAIN_VARIANTS)}")
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = [(v, s) for s in seeds for v in variants]
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    data_dir = os.path.join(tmp, "tfds")  # prepared once here, read by every run
    config = train_config(variants[0], seeds[0], args.train_steps, {}, data_dir)
    corpus.prepare_pystdlib(data_dir, config.data.max_files)
    pending, running = list(runs), []
    while pending or running:
      while pending and len(running) < max(args.jobs, 1):
        variant, seed = pending.pop(0)
        path = os.path.join(tmp, f"{variant}_{seed}.json")
        cmd = [
          sys.executable,
          __file__,
          f"--train_steps={args.train_steps}",
          "--_data_dir",
          data_dir,
          f"--moe_overrides={args.moe_overrides}",
          "--_train_one",
          variant,
          str(seed),
          path,
        ]
        running.append((variant, seed, path, subprocess.Popen(cmd)))
      time.sleep(1)
      for item in list(running):
        variant, seed, path, proc = item
        if proc.poll() is None:
          continue
        running.remove(item)
        if proc.returncode:
          raise SystemExit(f"training {variant} seed {seed} failed (exit {proc.returncode})")
        with open(path) as f:
          out[f"{variant}/{seed}"] = row = json.load(f)
        print(
          f"trained {variant} seed {seed}: ce {row['ce'][-1]:.3f} in {row['wall_s']:.0f} s",
          file=sys.stderr,
        )
  return out


def train_table(args, rows: dict) -> None:
  n, steps = args.last, args.train_steps
  quarters = [steps * q // 4 for q in (1, 2, 3, 4)]
  print(
    f"\nTraining, {steps} steps of 16 x 128 tokens on the built-in corpus, one device; "
    f"ce_loss; last{n}: mean of the last {n} steps; delta and d@t: that minus dense's (same "
    f"seed), d@t over the {n} steps ending at step t; dropped: mean fraction of assignments:"
  )
  head = "".join(f"{f'd@{t}':>8}" for t in quarters[:-1])
  print(
    f"{'variant':<22} {'seed':>4} {'params':>7} {'active':>7} {'final':>7} {'last' + str(n):>7} "
    f"{'delta':>7}{head} {'dropped':>8}"
  )
  deltas = {}
  for r in rows.values():
    ce = np.asarray(r["ce"])
    dense = rows.get(f"dense/{r['seed']}")

    def window(c, t):
      return float(np.mean(c[max(t - n, 0) : t]))

    def delta_at(t, ce=ce, dense=dense):
      return window(ce, t) - window(np.asarray(dense["ce"]), t) if dense else float("nan")

    delta = delta_at(steps)
    r["ce_last_mean"], r["delta_vs_dense"] = window(ce, steps), delta
    deltas.setdefault(r["variant"], []).append(delta)
    windows = "".join(f"{delta_at(t):>+8.3f}" for t in quarters[:-1])
    dropped = f"{r['dropped_mean']:>8.3f}" if "dropped_mean" in r else f"{'-':>8}"
    print(
      f"{r['variant']:<22} {r['seed']:>4} {r['params'] / 1e6:>6.2f}M "
      f"{r['active_params'] / 1e6:>6.2f}M {ce[-1]:>7.3f} {window(ce, steps):>7.3f} "
      f"{delta:>+7.3f}{windows} {dropped}"
    )
  print(f"\nmean delta vs dense over seeds (last {n} steps; negative: lower loss than dense):")
  for variant, d in deltas.items():
    if variant != "dense":
      wins = sum(x < 0 for x in d)
      print(
        f"  {variant:<22} {np.mean(d):+.3f} (min {min(d):+.3f}, max {max(d):+.3f}; "
        f"lower in {wins} of {len(d)} seeds)"
      )


def main(argv=None):
  args = parse_args(argv)
  if args._train_one:
    return train_one(args)
  results = {"devices": len(jax.devices()), "device_kind": jax.devices()[0].device_kind}
  if args.repeats:
    results["timing"] = time_sides(args)
    base = results["timing"]["dense"]["ms_per_step"]
    print(f"\nStep time, median of {args.repeats} blocks of {args.steps} steps (8 CPU devices):")
    print(f"{'side':<18} {'ms/step':>9} {'vs dense':>9} {'dropped':>8} {'compile s':>10}")
    for name, r in results["timing"].items():
      print(
        f"{name:<18} {r['ms_per_step']:>9.1f} {r['ms_per_step'] / base:>8.2f}x "
        f"{r['dropped_fraction']:>8.3f} {r['compile_s']:>10.1f}"
      )
  if args.train_steps:
    results["train"] = train_compare(args)
    train_table(args, results["train"])
  print()
  common.write_json(args.out, results)


if __name__ == "__main__":
  main()
