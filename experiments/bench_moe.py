"""Mixture of Experts on 8 simulated CPU devices: step time of MoE vs a dense model with the same
active FLOPs, capacity-based vs dropless routing, and a training comparison, in one run.

Run (about 10 minutes on 2 cores, most of it the two 300-step trainings):
  python experiments/bench_moe.py
  python experiments/bench_moe.py --train_steps=0 --repeats=5      # timings only
Options: --steps (per timed block), --repeats (timed blocks per side), --train_steps (0: skip
the training comparison), --out (JSON of every number).

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

Training: pwtrain.train.run for --train_steps steps of the built-in corpus on each of
palm_tiny and palm_tiny_moe (same data order, optimizer and seed). Compared on ce_loss (the
MoE run's `loss` also holds its weighted aux losses): at the last step and the mean of the last
20 steps.

Caveat: simulated CPU devices share 2 cores; XLA's CPU all-to-all and the ragged_dot fallback
are not what a TPU/GPU does. The timings say what each layout costs here, not on accelerators.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
  re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
  + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pwtrain import config as config_lib  # noqa: E402
from pwtrain import optim, train  # noqa: E402
from pwtrain.backend import Controller  # noqa: E402
from pwtrain.parallel import build_step_program  # noqa: E402
from pwtrain.parallel import plan as plan_lib  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
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


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=5, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=5, help="timed blocks per side")
  p.add_argument("--train_steps", type=int, default=300, help="0: skip the training comparison")
  p.add_argument("--out", default="/tmp/bench_moe.json")
  return p.parse_args(argv)


def load_config(name: str, overrides: dict):
  path = REPO / "configs" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.unlock()
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  config_lib.validate(config)
  return config


def random_batches(config, num: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  shape = (config.train.global_batch, config.data.seq_len + 1)
  out = []
  for _ in range(num):
    tokens = rng.integers(1, 258, size=shape).astype(np.int32)  # byte tokens, as the corpus
    out.append({"inputs": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy()})
  return out


class Side:
  """One compiled step program and its Controller; the state is threaded through its steps."""

  def __init__(self, config, batches):
    self.batches, self.i = batches, 0
    cluster = plan_lib.make_cluster(config)
    plan = plan_lib.build(config, cluster)
    tx, schedule = optim.build(config.optim, config.train.num_steps)
    self.controller = Controller(cluster, max_inflight=config.backend.max_inflight_steps)
    start = time.perf_counter()
    self.program = build_step_program(config, plan, self.controller, tx, schedule)
    self.compile_s = time.perf_counter() - start
    self.state = self.program.init()
    self.last_metrics = None

  def run(self, n: int) -> float:
    """Seconds per step over n steps, from the first dispatch to the last step's outputs."""
    start = time.perf_counter()
    for _ in range(n):
      batch = self.batches[self.i % len(self.batches)]
      self.i += 1
      out = self.controller.run(self.program.program, {**self.state, **self.program.feed(batch)})
      self.state = {k: out[k] for k in self.program.state_keys}
    self.last_metrics = jax.device_get(out["metrics"].result())
    jax.block_until_ready([v.result() for v in self.state.values()])
    seconds = (time.perf_counter() - start) / n
    self.state = {k: v.result() for k, v in self.state.items()}
    return seconds

  def close(self):
    self.controller.wait()
    self.controller.close()


def time_sides(args) -> dict:
  sides = {}
  for name, (config_name, overrides) in SIDES.items():
    config = load_config(config_name, overrides)
    sides[name] = Side(config, random_batches(config, 8))
    sides[name].run(1)  # warm-up: first dispatch, allocator
    print(f"compiled {name} in {sides[name].compile_s:.1f} s", file=sys.stderr)
  times = {name: [] for name in sides}
  for _ in range(args.repeats):
    for name, side in sides.items():
      times[name].append(side.run(args.steps))
  rows = {}
  for name, side in sides.items():
    m = side.last_metrics
    rows[name] = {
      "ms_per_step": 1e3 * statistics.median(times[name]),
      "blocks_ms": [1e3 * t for t in times[name]],
      "compile_s": side.compile_s,
      "dropped_fraction": float(m.get("moe_dropped_fraction", 0.0)),
    }
    side.close()
  return rows


def train_compare(steps: int) -> dict:
  out = {}
  for name in ("palm_tiny", "palm_tiny_moe"):
    config = load_config(name, {"train.num_steps": steps, "train.checkpoint_every": steps})
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      result = train.run(config, workdir, show_progress=False)
      wall = time.perf_counter() - start
    ce = [r["ce_loss"] for r in result.history]
    out[name] = {
      "ce_first": ce[0],
      "ce_last": ce[-1],
      "ce_last20_mean": float(np.mean(ce[-20:])),
      "loss_last": result.history[-1]["loss"],
      "wall_s": wall,
      "params": plan_lib.param_count(config),
      "active_params": plan_lib.param_count(config, active=True),
    }
    last = result.history[-1]
    if "moe_aux_loss" in last:
      out[name].update(
        {k: last[k] for k in ("moe_aux_loss", "moe_dropped_fraction", "moe_load_max")}
      )
    print(f"trained {name}: {out[name]}", file=sys.stderr)
  return out


def main(argv=None):
  args = parse_args(argv)
  results = {"devices": len(jax.devices()), "device_kind": jax.devices()[0].device_kind}
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
    results["train"] = train_compare(args.train_steps)
    print(f"\nTraining, {args.train_steps} steps on the built-in corpus (ce_loss):")
    print(f"{'config':<14} {'params':>9} {'active':>9} {'first':>7} {'last':>7} {'last20':>7}")
    for name, r in results["train"].items():
      print(
        f"{name:<14} {r['params'] / 1e6:>8.2f}M {r['active_params'] / 1e6:>8.2f}M "
        f"{r['ce_first']:>7.3f} {r['ce_last']:>7.3f} {r['ce_last20_mean']:>7.3f}"
      )
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
