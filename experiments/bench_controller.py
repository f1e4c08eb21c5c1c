"""Step time through pwtrain's Controller vs a plain `jax.jit` loop, in one run, same devices.

Run (8 simulated CPU devices, all data-parallel; then one device):
  python experiments/bench_controller.py
  python experiments/bench_controller.py --devices 1 --out /tmp/bench_controller_1dev.json
Options: --config=palm_tiny, --set parallel.data=8 (any config key, repeatable),
--steps (per timed block), --warmup, --repeats, --devices (or env PWTRAIN_BENCH_DEVICES).

What it measures. Both sides run the same compiled train step (pwtrain.step's model_fns ->
loss_and_grads -> accumulate -> apply_update -> train_step, the same in/out shardings, the
state donated) on the same mesh, over the same pre-generated numpy batches, so data loading is
excluded:
  pwtrain: `harness.step(state, batch, i)` (pwtrain.harness: `controller.run(program_for(i),
           {**state, **feed(batch)})`) as train.py calls it, the state threaded as futures;
  jit:     `state, metrics = step(state, batch)` in a Python loop, where `step` is `jax.jit` of
           the same function with in_shardings, so jit moves the numpy batch to the devices
           (--jit_device_put: `jax.device_put(batch, batch_sharding)` first, as the controller's
           transfer node does; slower on GPU).
Blocks of --steps steps alternate (pwtrain, jit, pwtrain, jit, ...) --repeats times so that
machine noise hits both alike; a block is timed from its first dispatch to
`jax.block_until_ready` of its last step's outputs. Reported: the median per-step time of each,
the ratio jit_time / pwtrain_time (1.0 = no overhead; the target is >= 0.97), the time a
dispatch call takes to return (median over all calls, and over each block's first call, which
the controller's `max_inflight` bound never holds back), and the largest difference between
the two sides' first-step losses and final params (the same steps from the same init ran on
both: 0 on CPU, and on GPU with XLA_FLAGS=--xla_gpu_deterministic_ops=true; without it GPU
reductions are non-deterministic and the params drift apart over the steps).
"""

import argparse
import os
import sys

import common


def _device_count(argv) -> int:
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--devices", type=int, default=int(os.environ.get("PWTRAIN_BENCH_DEVICES", 8)))
  return pre.parse_known_args(argv)[0].devices


NUM_DEVICES = _device_count(sys.argv[1:])
common.force_host_devices(NUM_DEVICES)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from pwtrain import guard  # noqa: E402
from pwtrain import sharding as sharding_lib  # noqa: E402
from pwtrain import step as step_lib  # noqa: E402
from pwtrain.backend import controller as controller_lib  # noqa: E402
from pwtrain.harness import Harness  # noqa: E402
from pwtrain.parallel import spmd  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  common.add_config_args(p)
  p.add_argument("--steps", type=int, default=10, help="steps per timed block")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
  p.add_argument("--repeats", type=int, default=6, help="timed blocks per side")
  p.add_argument("--num_batches", type=int, default=8, help="distinct batches, cycled")
  p.add_argument("--devices", type=int, default=NUM_DEVICES, help="simulated CPU devices")
  p.add_argument(
    "--jit_device_put",
    action="store_true",
    help="jit side: device_put each batch first instead of passing numpy to jit",
  )
  p.add_argument("--out", default="/tmp/bench_controller.json")
  args = p.parse_args(argv)
  if min(args.steps, args.warmup, args.repeats, args.num_batches) < 1:
    p.error("--steps, --warmup, --repeats and --num_batches must be >= 1")
  return args


def build_plain_jit(config, mesh, tx, schedule):
  """The same step as spmd.build, as an ordinary jax.jit; returns (step, init, batch_sharding)."""
  fns = step_lib.model_fns(config.model)
  init_fn = lambda: step_lib.init_state(fns, tx, config.seed)
  shardings = spmd.state_shardings(fns, mesh, jax.eval_shape(init_fn))
  batch_sharding = sharding_lib.named_sharding(mesh, ("batch", "length"))
  grad_fn = step_lib.accumulate(
    step_lib.loss_and_grads(fns, z_loss=config.model.z_loss), config.train.num_microbatches
  )
  # The same update as spmd.build, including the skip of non-finite steps (pwtrain.guard).
  update = guard.wrap_update(
    step_lib.apply_update(tx, schedule, config.optim.clip_norm), config.train
  )
  train_step = step_lib.train_step(grad_fn, update)
  step = jax.jit(
    train_step,
    in_shardings=(shardings, {"inputs": batch_sharding, "targets": batch_sharding}),
    out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
    donate_argnums=(0,),
  )
  init = jax.jit(init_fn, out_shardings=shardings)
  return step, init, batch_sharding


def main(argv=None):
  args = parse_args(argv)
  load = common.Load()
  config = common.load_config(args.config, common.parse_sets(args.set))
  harness = Harness.build(config)
  plan = harness.plan
  if not plan.single_island:
    raise SystemExit("bench_controller compares one island's spmd step: set parallel.islands=1")
  mesh = harness.cluster.islands[0].mesh(plan.mesh_shape)
  batches = common.random_batches(config, args.num_batches)
  jit_step, jit_init, batch_sharding = build_plain_jit(config, mesh, harness.tx, harness.schedule)

  sides = {
    "pwtrain": {"state": harness.init(), "i": 0, "blocks": [], "dispatch": [], "first": []},
    "jit": {"state": jit_init(), "i": 0, "blocks": [], "dispatch": [], "first": []},
  }

  def run_pwtrain(n: int, record: bool) -> float:
    side = sides["pwtrain"]
    state, dispatch = side["state"], []
    start = time.perf_counter()
    for _ in range(n):
      t = time.perf_counter()
      out = harness.step(state, batches[side["i"] % len(batches)], side["i"])
      dispatch.append(time.perf_counter() - t)
      if side["i"] == 0:
        side["first_metrics"] = out.metrics
      state, side["i"] = out.state, side["i"] + 1
    jax.block_until_ready([f.result() for f in (out.metrics, *out.state.values())])
    elapsed = time.perf_counter() - start
    harness.controller.wait()  # drains the in-flight deque (all done already), outside the timing
    side["state"] = state
    if record:
      side["blocks"].append(elapsed / n)
      side["dispatch"].extend(dispatch)
      side["first"].append(dispatch[0])
    return elapsed

  def run_jit(n: int, record: bool) -> float:
    side = sides["jit"]
    state, dispatch = side["state"], []
    start = time.perf_counter()
    for _ in range(n):
      t = time.perf_counter()
      batch = batches[side["i"] % len(batches)]
      if args.jit_device_put:
        batch = jax.device_put(batch, batch_sharding)
      state, metrics = jit_step(state, batch)
      dispatch.append(time.perf_counter() - t)
      if side["i"] == 0:
        side["first_metrics"] = metrics
      side["i"] += 1
    jax.block_until_ready((state, metrics))
    elapsed = time.perf_counter() - start
    side["state"] = state
    if record:
      side["blocks"].append(elapsed / n)
      side["dispatch"].extend(dispatch)
      side["first"].append(dispatch[0])
    return elapsed

  # The jit step traces on its first call: resolve the model's activation constraints on
  # `mesh`, as Controller.compile does.
  with sharding_lib.activate(mesh):
    t0 = time.perf_counter()
    run_pwtrain(args.warmup, record=False)
    run_jit(args.warmup, record=False)
    print(f"warmup ({args.warmup} steps each, incl. jit compile): {time.perf_counter() - t0:.1f}s")
    for r in range(args.repeats):
      a = run_pwtrain(args.steps, record=True)
      b = run_jit(args.steps, record=True)
      print(
        f"repeat {r}: pwtrain {a / args.steps * 1e3:8.2f} ms/step   "
        f"jit {b / args.steps * 1e3:8.2f} ms/step   ratio {b / a:.3f}"
      )

  pw_final = {k: f.result() for k, f in sides["pwtrain"]["state"].items()}
  final = {
    "pwtrain": jax.device_get(harness.step_program.to_checkpoint(pw_final)),
    "jit": jax.device_get(sides["jit"]["state"]),
  }
  first = {
    "pwtrain": jax.device_get(sides["pwtrain"]["first_metrics"].result()),
    "jit": jax.device_get(sides["jit"]["first_metrics"]),
  }
  first_loss_diff = abs(float(first["pwtrain"]["loss"]) - float(first["jit"]["loss"]))
  harness.close()
  param_diff = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(final["pwtrain"]["params"]),
      jax.tree.leaves(final["jit"]["params"]),
      strict=True,
    )
  )

  ms = common.median_ms
  summary = {
    name: {
      "step_ms": ms(s["blocks"]),
      "min_step_ms": min(s["blocks"]) * 1e3,
      "dispatch_ms": ms(s["dispatch"]),
      "first_dispatch_ms": ms(s["first"]),
      "blocks_step_ms": [x * 1e3 for x in s["blocks"]],
    }
    for name, s in sides.items()
  }
  pw, jt = summary["pwtrain"], summary["jit"]
  ratio = jt["step_ms"] / pw["step_ms"]
  paired = statistics.median(
    b / a for a, b in zip(sides["pwtrain"]["blocks"], sides["jit"]["blocks"], strict=True)
  )
  print()
  print(
    f"devices={len(jax.devices())} ({jax.devices()[0].platform}) mesh={plan.mesh_shape} "
    f"batch={config.train.global_batch}x{config.data.seq_len} "
    f"max_inflight={config.backend.max_inflight_steps} "
    f"steps={args.steps} x repeats={args.repeats}"
  )
  print(f"{'':10}{'step ms median':>16}{'min':>10}{'dispatch ms':>14}{'1st dispatch ms':>17}")
  for name in ("pwtrain", "jit"):
    s = summary[name]
    print(
      f"{name:10}{s['step_ms']:16.2f}{s['min_step_ms']:10.2f}{s['dispatch_ms']:14.3f}"
      f"{s['first_dispatch_ms']:17.3f}"
    )
  target = "OK" if ratio >= 0.97 else "BELOW TARGET 0.97"
  print(f"ratio jit/pwtrain: {ratio:.3f} (median of paired blocks {paired:.3f})  {target}")
  loadavg = load.report()
  print(
    f"first-step loss: pwtrain {float(first['pwtrain']['loss']):.6f}, "
    f"jit {float(first['jit']['loss']):.6f} (|diff| {first_loss_diff:.3g})"
  )
  print(f"max |params_pwtrain - params_jit| after identical steps: {param_diff:.3g}")

  result = {
    "config": args.config,
    "overrides": args.set,
    **common.machine(),
    **loadavg,
    # Which controller was measured (pwtrain/backend is being edited).
    "controller_sha256": common.source_sha256(controller_lib),
    "mesh_shape": plan.mesh_shape,
    "global_batch": config.train.global_batch,
    "seq_len": config.data.seq_len,
    "max_inflight": config.backend.max_inflight_steps,
    "jit_device_put": args.jit_device_put,
    "steps": args.steps,
    "warmup": args.warmup,
    "repeats": args.repeats,
    "pwtrain": pw,
    "jit": jt,
    "ratio_jit_over_pwtrain": ratio,
    "ratio_paired_median": paired,
    "target_met": ratio >= 0.97,
    "first_step_loss_diff": first_loss_diff,
    "max_param_diff": param_diff,
  }
  common.write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
