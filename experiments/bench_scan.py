"""Scanned layers (model.scan_layers): compile time against depth, and what scan and remat cost
in training throughput, unrolled and scanned side by side in one run.

Run (about 10 minutes on 2 cores):
  python experiments/bench_scan.py
  python experiments/bench_scan.py --layers=4,16 --compile_repeats=3 --devices=1 --out=/tmp/bs.json
Options: --layers (depths of the compile-time sweep), --compile_repeats, --devices (device counts
of the throughput sweep), --remats, --steps (per timed block), --repeats (timed blocks per side),
--skip_compile / --skip_throughput, --out (JSON of every number).

Compile time: the train step (loss, gradients, AdamW update; step.train_step, the function the
SPMD step program compiles) of a palm_tiny-shaped model (d_model 128, 8 heads of 16, MQA, d_ff
512, seq 128, global batch 16, float32, one device), lowered (`jax.jit(...).lower`: tracing and
StableHLO) and compiled (XLA), at each depth, unrolled and scanned; each repeat is a fresh
function (no cache of any kind), the two layouts alternating. Reported: median seconds of lower,
compile and their sum, and the sum at each depth over the sum at the first depth (target: with
scan, 64 layers within 1.5x of 4).

Throughput: the comparison config (4 layers, d_model 256, 8 heads of 32, MQA (num_kv_heads 1),
d_ff 1024, seq 256, global batch 16, AdamW, float32) as one pwtrain step program through the
Harness (data parallel over the devices), scan off and on, each remat policy. Every side is
built first; then timed blocks of --steps steps go round all sides, --repeats times, so that
machine noise hits all alike. Reported: median tokens/s per side, and scanned over unrolled for
each policy (target at remat=none: >= 0.95, i.e. scan costs at most 5%). Measured with
`--skip_compile --devices=1,8` (load up to 7.8): 0.96 on 1 device, 1.06 on 8 (0.88 / 1.10 with
the scanned policy alone, 0.80 / 0.93 before either change; docs/benchmarks.md).

Caveat: CPU devices simulated by XLA on 2 shared cores; compile times are XLA:CPU's, and the
throughput ratios, not the absolute figures, are what carries over.
"""

import argparse
import statistics
import sys
import time

import common

common.force_host_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pwtrain import optim  # noqa: E402
from pwtrain import step as step_lib  # noqa: E402
from pwtrain.harness import Harness  # noqa: E402

COMPILE_MODEL = {
  "model.d_model": 128,
  "model.num_heads": 8,
  "model.num_kv_heads": 1,
  "model.head_dim": 16,
  "model.d_ff": 512,
  "data.seq_len": 128,
  "train.global_batch": 16,
  "optim.name": "adamw",
}
COMPARISON = {
  **common.COMPARISON_MODEL,
  "data.seq_len": 256,
  "train.global_batch": 16,
  "optim.name": "adamw",
  "model.dtype": "float32",
  "model.param_dtype": "float32",
  "parallel.data": -1,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", default="4,16,64", help="depths of the compile-time sweep")
  p.add_argument("--compile_repeats", type=int, default=3)
  p.add_argument("--devices", default="1,8", help="device counts of the throughput sweep")
  p.add_argument("--remats", default="none,full,dots,outputs")
  p.add_argument("--steps", type=int, default=2, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=3, help="timed blocks per side")
  p.add_argument("--skip_compile", action="store_true")
  p.add_argument("--skip_throughput", action="store_true")
  p.add_argument("--out", default="/tmp/bench_scan.json")
  return p.parse_args(argv)


# -- compile time ---------------------------------------------------------------------------------


def lower_and_compile(config) -> tuple[float, float]:
  """(lower s, compile s) of a fresh jit of the config's train step on one device."""
  fns = step_lib.model_fns(config.model, config.moe)
  tx, schedule = optim.build(config.optim, config.train.num_steps)
  grad_fn = step_lib.loss_and_grads(fns, z_loss=config.model.z_loss)
  update = step_lib.apply_update(tx, schedule, config.optim.clip_norm)
  step = step_lib.train_step(grad_fn, update)
  state = jax.eval_shape(lambda: step_lib.init_state(fns, tx, config.seed))
  shape = (config.train.global_batch, config.data.seq_len)
  batch = {k: jax.ShapeDtypeStruct(shape, np.int32) for k in ("inputs", "targets")}
  start = time.perf_counter()
  lowered = jax.jit(lambda s, b: step(s, b), donate_argnums=(0,)).lower(state, batch)
  lowered_s = time.perf_counter() - start
  lowered.compile()
  return lowered_s, time.perf_counter() - start - lowered_s


def compile_sweep(args) -> list[dict]:
  depths = [int(n) for n in args.layers.split(",")]
  times = {(n, scan): [] for n in depths for scan in (False, True)}
  for repeat in range(args.compile_repeats):
    for n in depths:
      for scan in (False, True):
        config = common.load_config(
          "palm_tiny", {**COMPILE_MODEL, "model.num_layers": n, "model.scan_layers": scan}
        )
        times[(n, scan)].append(lower_and_compile(config))
        lower, comp = times[(n, scan)][-1]
        print(
          f"  repeat {repeat}: {n} layers {'scanned' if scan else 'unrolled'}: lower "
          f"{lower:.2f} s, compile {comp:.2f} s",
          file=sys.stderr,
        )
  rows = []
  for scan in (False, True):
    base = None
    for n in depths:
      lower = statistics.median(t[0] for t in times[(n, scan)])
      comp = statistics.median(t[1] for t in times[(n, scan)])
      total = statistics.median(t[0] + t[1] for t in times[(n, scan)])
      base = base or total
      rows.append(
        {"layers": n, "scan": scan, "lower_s": lower, "compile_s": comp, "total_s": total,
         "vs_first_depth": total / base, "samples": times[(n, scan)]}
      )  # fmt: skip
  return rows


def print_compile(rows: list[dict]) -> None:
  print("\nCompile time of the train step (median s; AdamW, d_model 128, 1 device):")
  print(f"{'layout':<9} {'layers':>6} {'lower':>7} {'compile':>8} {'total':>7} {'vs first':>9}")
  for r in rows:
    print(
      f"{'scanned' if r['scan'] else 'unrolled':<9} {r['layers']:>6} {r['lower_s']:>7.2f} "
      f"{r['compile_s']:>8.2f} {r['total_s']:>7.2f} {r['vs_first_depth']:>8.2f}x"
    )


# -- throughput -----------------------------------------------------------------------------------


def throughput_sweep(args) -> list[dict]:
  remats = args.remats.split(",")
  rows = []
  for num_devices in [int(n) for n in args.devices.split(",")]:
    devices = jax.devices()[:num_devices]
    sides = {}
    for remat in remats:
      for scan in (False, True):
        config = common.load_config(
          "palm_tiny", {**COMPARISON, "model.remat": remat, "model.scan_layers": scan}
        )
        batches = common.random_batches(config, 2)
        side = common.Side(Harness.build(config, devices), batches)
        side.run(1)  # warm up: first dispatch of every executable
        sides[(remat, scan)] = side
        print(
          f"  {num_devices} device(s), remat={remat}, scan={scan}: compiled in "
          f"{side.harness.compile_s:.1f} s",
          file=sys.stderr,
        )
    tokens = COMPARISON["train.global_batch"] * COMPARISON["data.seq_len"]
    seconds = {key: [] for key in sides}
    for _ in range(args.repeats):
      for key, side in sides.items():
        seconds[key].append(side.run(args.steps))
    for side in sides.values():
      side.close()
    for remat in remats:
      off, on = (statistics.median(seconds[(remat, s)]) for s in (False, True))
      rows.append(
        {"devices": num_devices, "remat": remat, "unrolled_tokens_per_s": tokens / off,
         "scanned_tokens_per_s": tokens / on, "scanned_vs_unrolled": off / on,
         "samples_s": {"unrolled": seconds[(remat, False)], "scanned": seconds[(remat, True)]}}
      )  # fmt: skip
  return rows


def print_throughput(rows: list[dict], args) -> None:
  print(
    f"\nTraining throughput (median tokens/s of {args.repeats} blocks of {args.steps} steps; "
    "4 layers, d_model 256, seq 256, batch 16, AdamW):"
  )
  print(f"{'devices':>7} {'remat':<8} {'unrolled':>9} {'scanned':>9} {'scan/unrolled':>14}")
  base = {}
  for r in rows:
    base.setdefault(r["devices"], r["unrolled_tokens_per_s"])
    print(
      f"{r['devices']:>7} {r['remat']:<8} {r['unrolled_tokens_per_s']:>9.0f} "
      f"{r['scanned_tokens_per_s']:>9.0f} {r['scanned_vs_unrolled']:>13.3f}x"
    )
  print("(each policy vs unrolled remat=none, scanned:", end="")
  for r in rows:
    print(f" {r['devices']}dev {r['remat']} {r['scanned_tokens_per_s'] / base[r['devices']]:.3f}",
          end=";")  # fmt: skip
  print(")")


def main(argv=None):
  args = parse_args(argv)
  load = common.Load()
  results = {"machine": common.machine(), "args": vars(args)}
  start = time.perf_counter()
  if not args.skip_compile:
    results["compile"] = compile_sweep(args)
  if not args.skip_throughput:
    results["throughput"] = throughput_sweep(args)
  if "compile" in results:
    print_compile(results["compile"])
  if "throughput" in results:
    print_throughput(results["throughput"], args)
  results["load"] = load.report()
  results["wall_s"] = time.perf_counter() - start
  print(f"\n{results['wall_s'] / 60:.1f} minutes")
  common.write_json(args.out, results)


if __name__ == "__main__":
  main()
