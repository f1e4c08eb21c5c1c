"""Pods: 2 data-parallel pods x 4 devices vs one island of 8, gradient-exchange overlap, and the
loss cost of the relaxed exchanges, in one run.

Run (8 simulated CPU devices; about 5-6 minutes on 2 cores):
  python experiments/bench_pods.py
  python experiments/bench_pods.py --sections=throughput --repeats=5 --out=/tmp/bench_pods.json
Options: --config (default palm_tiny), --set KEY=VALUE (any config key, repeatable,
applied to every side of sections 1-2), --modes (pod variants of section 1), --steps (per timed
block), --repeats, --train_steps and --inner_steps (section 3), --sections, --compile_cache (keep
compiled pieces between runs), --no_concurrent (skip the 1-device-island overlap line).

1. Throughput. Model: palm_tiny widened to d_model 256 (d_ff 1024, 8 heads of 32, multi-query),
   4 layers, sequence 128, global batch 16, vocab 512. The same model and global batch run as
     single      ONE island of all 8 devices, data parallel (the spmd step);
     pods        parallel.islands=2, parallel.pods=2: two islands of 4 devices, data parallel
                 inside, each pod computes half of the batch and the pods exchange gradients
                 (exchange.mode sync, overlapped with exchange.buckets chunks, stale, diloco;
                 sync with exchange.compression bf16 and int8).
   Steps go through the Controller exactly as pwtrain.train drives them
   (`controller.run(program.program_for(i), {**state, **program.feed(batch)})`, dispatch without
   waiting, backend.max_inflight_steps in flight) on pre-generated synthetic batches (no data
   loading). A block of --steps steps is timed from its first dispatch until every output of its
   last step is ready; blocks of all sides alternate (single, sync, overlapped, ..., single,
   sync, ...) --repeats times so machine noise hits all alike; the median block is reported.
   ratio = single ms / pods ms (throughput of the pods relative to one island; the Pathways
   paper reports 97% for 2 x 1024 TPU cores vs one island of 2048). DiLoCo's inner steps (no
   exchange) and its outer step (inner step + delta exchange + outer update) are timed
   separately, each in its own blocks, and combined as ((H-1) * inner + outer) / H for
   H = exchange.inner_steps.

2. Exchange overlap. One step of sync and of overlapped is run again on a Controller with a
   Trace. For each pod p: bwd_end = when the last backward node of p (p:FB*, p:B*) finished;
   the exchange work of p is what its island runs for the exchange: the incoming gradient
   transfers q>p:g* and p:reduce* (and p:enc* with compression). Reported: the fraction of these
   nodes started, and finished, before bwd_end, and the fraction of their run time that lies
   before bwd_end ("hidden"), averaged over the pods.
   CAVEAT: on CPU the Controller serializes execution (serialize_execution, on by default there:
   XLA's CPU runtime deadlocks when several multi-device computations with collectives run at
   once), so nothing runs concurrently and nothing is truly hidden: every node's time adds to
   the step. On CPU these fractions are STRUCTURAL: how much exchange work the schedule issues
   and completes before the backward ends, i.e. what could overlap on hardware that runs
   transfers and compute at once. Under serialization a node's start and end are exact: the
   scheduler stamps `launch` just before the computation starts and `done` once it has finished,
   both while holding the lock that runs one computation at a time.
   --concurrent line (unless --no_concurrent): the same two modes with pods of ONE device each
   (no collectives, so serialize_execution=False is safe), timed in alternating blocks and
   traced: here compute and transfers of the two pods do run at once (on the machine's cores),
   so the fractions are measured overlap; the start of a node is estimated as the later of its
   launch and the end of the previous node on its island.

3. Loss margins. palm_tiny (configs/palm_tiny.py, its data: the built-in Python-stdlib corpus)
   trained with pwtrain.train.run for --train_steps steps on 2 pods (2 x 4 devices) in sync,
   stale and diloco (exchange.inner_steps = --inner_steps); final loss = mean of the last 10
   steps' logged loss (for DiLoCo the loss each pod sees at its own inner parameters, summed
   over pods, as pwtrain logs it); delta = final - sync final (negative: lower loss than sync).
"""

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import common

common.force_host_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pwtrain import train  # noqa: E402
from pwtrain.backend import Controller, Node, Trace  # noqa: E402
from pwtrain.harness import Harness  # noqa: E402

MODEL = {
  "model.d_model": 256,
  "model.d_ff": 1024,
  "model.num_heads": 8,
  "model.head_dim": 32,
  "model.num_layers": 4,
  "data.seq_len": 128,
  "train.global_batch": 16,
}
SINGLE = {"parallel.islands": 1, "parallel.pods": 1, "parallel.data": -1}
PODS = {"parallel.islands": 2, "parallel.pods": 2, "parallel.data": -1}
# Section-1 pod variants: name -> exchange overrides.
VARIANTS = {
  "sync": {"exchange.mode": "sync"},
  "overlapped": {"exchange.mode": "overlapped"},
  "stale": {"exchange.mode": "stale"},
  "diloco": {"exchange.mode": "diloco"},
  "sync_bf16": {"exchange.mode": "sync", "exchange.compression": "bf16"},
  "sync_int8": {"exchange.mode": "sync", "exchange.compression": "int8"},
}
SECTIONS = ("throughput", "overlap", "loss")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  common.add_config_args(p)
  p.add_argument("--modes", default=",".join(VARIANTS), help="section-1 pod variants")
  p.add_argument("--steps", type=int, default=2, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=3, help="timed blocks per side")
  p.add_argument("--train_steps", type=int, default=100, help="section 3: steps per run")
  p.add_argument("--inner_steps", type=int, default=10, help="section 3: DiLoCo's H")
  p.add_argument("--sections", default=",".join(SECTIONS))
  p.add_argument("--compile_cache", default=None, help="persistent compile cache directory")
  p.add_argument("--no_concurrent", action="store_true", help="skip the 1-device-island line")
  p.add_argument("--out", default="/tmp/bench_pods.json")
  return p.parse_args(argv)


def make_side(config, batches, serialize_execution=None) -> common.Side:
  """One compiled step program on its own Controller, its state threaded from block to block."""
  harness = Harness.build(config, serialize_execution=serialize_execution)
  return common.Side(harness, batches)


def traced_step(side: common.Side, warmup: int = 1, serialize_execution=None) -> tuple[list, float]:
  """Runs `warmup` + 1 steps of `side` on a fresh traced Controller; the last step's events and
  its ms."""
  trace, harness = Trace(), side.harness
  controller = Controller(
    harness.cluster,
    max_inflight=harness.config.backend.max_inflight_steps,
    trace=trace,
    serialize_execution=serialize_execution,
  )
  side.harness = harness.with_controller(controller)
  try:
    side.run(warmup)
    ms = side.run(1) * 1e3
  finally:
    side.harness = harness
    controller.close()
  return [e for e in trace.events if e.step == warmup], ms


def state_waits_on(program) -> list:
  """The kinds of cross-pod transfers ("g" gradients, "d" DiLoCo deltas, "stats" loss sums...)
  that the step's output state depends on, i.e. that the next step's compute must wait for."""
  refs = {n.name: (n.args if isinstance(n, Node) else (n.src,)) for n in program.nodes}
  seen, todo = set(), [program.outputs[k][0] for k in program.carried]
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    todo += [r[0] for r in refs[name] if not isinstance(r, str)]
  return sorted({m[1] for n in seen if (m := re.fullmatch(r"\d+>\d+:([a-z]+)\d+", n))})


def throughput(args, model, variants, cache_note) -> dict:
  single_cfg = common.load_config(args.config, {**model, **SINGLE})
  batches = common.random_batches(single_cfg, 4)
  sides = {"single": make_side(single_cfg, batches)}
  print(f"compiled single in {sides['single'].harness.compile_s:.1f}s", flush=True)
  for name in variants:
    config = common.load_config(args.config, {**model, **PODS, **VARIANTS[name]})
    sides[name] = make_side(config, batches)
    print(f"compiled {name} in {sides[name].harness.compile_s:.1f}s{cache_note}", flush=True)
  # Timed blocks: (label, side, fixed program or None).
  blocks = []
  for name, side in sides.items():
    if name == "diloco":
      blocks.append(("diloco_inner", side, side.step_program.program))
      blocks.append(("diloco_outer", side, side.step_program.programs["outer"]))
    else:
      blocks.append((name, side, None))
  for _, side, program in blocks:  # warm up every executable
    side.run(1, program)
  times = {label: [] for label, _, _ in blocks}
  for r in range(args.repeats):
    for label, side, program in blocks:
      times[label].append(side.run(args.steps, program))
    print(f"  round {r + 1}/{args.repeats} done", flush=True)
  med = {k: statistics.median(v) for k, v in times.items()}
  single = med["single"]
  rows = []
  for label, side, program in blocks:
    row = _row(label, med[label], single, times[label], times["single"], side)
    # Where the step's time goes: each node run alone (least of two profiled steps).
    runs = [side.profile(program) for _ in range(2)]
    row["profile_ms"] = {k: min(r[k].seconds for r in runs) * 1e3 for k in runs[0]}
    row["kinds_ms"] = kinds(row["profile_ms"])
    row["state_waits_on"] = state_waits_on(program or side.step_program.program)
    rows.append(row)
  if "diloco" in sides:
    h = sides["diloco"].harness.config.exchange.inner_steps
    amort = ((h - 1) * med["diloco_inner"] + med["diloco_outer"]) / h
    rows.append(
      {
        "side": f"diloco_H{h}",
        "step_ms": amort * 1e3,
        "ratio": single / amort,
        "paired_ratio": None,
        "exchange_mb": sides["diloco"].step_program.exchange_bytes / 1e6 / h,
        "compile_s": None,
        "blocks_ms": None,
        "state_waits_on": None,
      }
    )
  return {"rows": rows, "sides": sides, "batches": batches}


def kind(name: str) -> str:
  """compute / exchange / optimizer / other, from a node name such as "1:B2.0" or "0>1:g3"."""
  pods, _, base = name.rpartition(":")
  if base == "train_step":
    return "fused"  # the single island's whole step: compute + optimizer in one computation
  if re.fullmatch(r"(FB|F|B)\d+\.\d+", base):
    return "compute"
  if (">" in pods and re.fullmatch(r"[gd]\d+", base)) or re.fullmatch(
    r"(reduce|enc|delta|outer)\d+", base
  ):
    return "exchange"
  if re.fullmatch(r"apply\d+", base):
    return "optimizer"
  return "other"


def kinds(profile_ms: dict) -> dict:
  out = {k: 0.0 for k in ("fused", "compute", "exchange", "optimizer", "other")}
  for name, ms in profile_ms.items():
    out[kind(name)] += ms
  out["serial"] = sum(profile_ms.values())
  out["nodes"] = len(profile_ms)
  return out


def _row(label, med, single, blocks, single_blocks, side) -> dict:
  paired = statistics.median(s / b for s, b in zip(single_blocks, blocks, strict=True))
  exchange = getattr(side.step_program, "exchange_bytes", 0)
  if label == "diloco_inner":
    exchange = 0
  return {
    "side": label,
    "step_ms": med * 1e3,
    "ratio": single / med,
    "paired_ratio": paired,
    "exchange_mb": exchange / 1e6,
    "compile_s": side.harness.compile_s,
    "blocks_ms": [b * 1e3 for b in blocks],
  }


def print_throughput(rows):
  header = f"{'side':14} {'step ms':>8} {'single/pods':>11} {'paired':>7} {'xchg MB/step':>12}"
  print(header)
  print("-" * len(header))
  for r in rows:
    paired = f"{r['paired_ratio']:7.3f}" if r["paired_ratio"] is not None else f"{'-':>7}"
    print(
      f"{r['side']:14} {r['step_ms']:8.1f} {r['ratio']:11.3f} {paired} {r['exchange_mb']:12.2f}"
    )
  print(
    f"\n{'side':14} {'serial ms':>9} {'fused':>6} {'compute':>7} {'exchange':>8} "
    f"{'optimizer':>9} {'other':>6} {'nodes':>5}  next step waits on"
  )
  for r in rows:
    k = r.get("kinds_ms")
    if k:
      print(
        f"{r['side']:14} {k['serial']:9.1f} {k['fused']:6.1f} {k['compute']:7.1f} "
        f"{k['exchange']:8.1f} {k['optimizer']:9.1f} {k['other']:6.1f} {k['nodes']:5d}  "
        f"{','.join(r['state_waits_on']) or '-'}"
      )
  print(
    "single/pods = median single-island step / median pods step (throughput relative to one "
    "island; >1 faster);\npaired = median over rounds of the same ratio within a round; xchg = "
    "bytes each pod sends the other per step.\nserial = one step run node by node, "
    "blocking on each (least of 2), split by node kind: fused = the single island's\nwhole "
    "step; compute = F/B/FB; exchange = cross-pod gradient/delta transfers, enc, reduce, delta, "
    "outer;\noptimizer = apply (every pod runs it); other = zeros, token/activation moves, "
    "finish, norms, stats.\nnext step waits on = cross-pod transfers (g: gradients, d: "
    "DiLoCo deltas, stats: loss sums) of THIS step\nthat the carried state depends on, so the "
    "next step cannot start before they arrive."
  )


def overlap_section(args, model, sides, batches) -> dict:
  out = {}
  for name in ("sync", "overlapped"):
    if name in sides:
      side = sides[name]
    else:
      config = common.load_config(args.config, {**model, **PODS, **VARIANTS[name]})
      side = make_side(config, batches)
    events, ms = traced_step(side)
    out[name] = {"step_ms": ms, **common.exchange_overlap(events, serialized=True)}
  if not args.no_concurrent:
    conc = {}
    one = {**model, **PODS, "parallel.devices_per_island": 1, "train.global_batch": 8}
    for name in ("sync", "overlapped"):
      config = common.load_config(args.config, {**one, **VARIANTS[name]})
      try:
        conc[name] = make_side(config, common.random_batches(config, 4), serialize_execution=False)
      except Exception as e:  # noqa: BLE001 - reported, the rest of the run goes on
        print(f"concurrent {name}: failed to build: {e!r}")
    if len(conc) == 2:
      for side in conc.values():
        side.run(1)
      blocks = {name: [] for name in conc}
      for _ in range(args.repeats):
        for name, side in conc.items():
          blocks[name].append(side.run(args.steps))
      for name, side in conc.items():
        events, ms = traced_step(side, serialize_execution=False)
        out[f"{name}_concurrent_1dev"] = {
          "step_ms": statistics.median(blocks[name]) * 1e3,
          "traced_step_ms": ms,
          "blocks_ms": [b * 1e3 for b in blocks[name]],
          **common.exchange_overlap(events, serialized=False),
        }
        side.close()
  return out


def print_overlap(rows: dict):
  header = (
    f"{'mode':26} {'step ms':>8} {'started<bwd':>11} {'finished<bwd':>12} {'hidden':>7} "
    f"{'xchg ms':>8}"
  )
  print(header)
  print("-" * len(header))
  for name, r in rows.items():
    print(
      f"{name:26} {r['step_ms']:8.1f} {r['started_before']:11.2f} {r['finished_before']:12.2f} "
      f"{r['hidden_time']:7.2f} {r['exchange_ms']:8.1f}"
    )
  print(
    "Fractions of each pod's exchange work (incoming gradient transfers q>p:g*, p:reduce*) "
    "started / finished /\nrun before the pod's last backward node finished, mean over pods. "
    "sync/overlapped rows (2 x 4 devices): the CPU\nController serializes execution, so this is "
    "STRUCTURAL overlap (work issued and completed before the backward\nends, which real "
    "hardware could hide); nothing ran concurrently and the exchange time adds to the step.\n"
    "*_concurrent_1dev rows: pods of one device each, serialize_execution=False: real overlap "
    "on this machine's cores."
  )


def loss_section(args, workdir: str) -> list:
  rows = []
  data_dir = os.path.join(workdir, "tfds")
  for mode in ("sync", "stale", "diloco"):
    config = common.load_config(
      "palm_tiny",
      {
        **PODS,
        "exchange.mode": mode,
        "exchange.inner_steps": args.inner_steps,
        "train.num_steps": args.train_steps,
        "train.checkpoint_every": args.train_steps,
        "train.log_every": max(args.train_steps // 5, 1),
        "data.data_dir": data_dir,
      },
    )
    t = time.perf_counter()
    result = train.run(config, os.path.join(workdir, mode), show_progress=False)
    losses = [row["loss"] for row in result.history if "loss" in row]
    rows.append(
      {
        "mode": mode,
        "steps": len(losses),
        "final_loss": float(np.mean(losses[-10:])),
        "first_loss": float(losses[0]),
        "seconds": time.perf_counter() - t,
        "losses": [float(x) for x in losses],
      }
    )
    print(f"  trained {mode}: {rows[-1]['final_loss']:.4f} in {rows[-1]['seconds']:.0f}s")
  sync = rows[0]["final_loss"]
  for r in rows:
    r["delta_vs_sync"] = r["final_loss"] - sync
  return rows


def print_loss(rows: list, args):
  header = f"{'mode':8} {'steps':>5} {'first':>7} {'final':>7} {'delta vs sync':>13} {'s':>5}"
  print(header)
  print("-" * len(header))
  for r in rows:
    print(
      f"{r['mode']:8} {r['steps']:5d} {r['first_loss']:7.4f} {r['final_loss']:7.4f} "
      f"{r['delta_vs_sync']:+13.4f} {r['seconds']:5.0f}"
    )
  print(
    f"palm_tiny on 2 pods x 4 devices, {args.train_steps} steps; final = mean loss of the last "
    f"10 steps; diloco H={args.inner_steps}."
  )


def main(argv=None):
  args = parse_args(argv)
  sections = args.sections.split(",")
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    raise SystemExit(f"--sections: unknown {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
  variants = [v for v in args.modes.split(",") if v]
  bad = set(variants) - set(VARIANTS)
  if bad:
    raise SystemExit(f"--modes: unknown {sorted(bad)}; valid: {', '.join(VARIANTS)}")
  load = common.Load()
  # Pieces shared by several sides (the pods' FB, init, zeros...) compile once.
  with common.compile_cache(args.compile_cache, "bench_pods_cache_"):
    result = _main(args, sections, variants)
  result.update(load.report())
  common.write_json(args.out, result)
  return result


def _main(args, sections, variants) -> dict:
  model = {**MODEL, **common.parse_sets(args.set)}
  workdir = tempfile.mkdtemp(prefix="bench_pods_")
  t_start = time.perf_counter()
  platform_name = jax.devices()[0].platform
  serialized = platform_name == "cpu"
  print(
    f"{len(jax.devices())} {platform_name} devices on {os.cpu_count()} cores; model "
    f"d_model={model['model.d_model']} layers={model['model.num_layers']} seq="
    f"{model['data.seq_len']} global_batch={model['train.global_batch']}; "
    f"{args.steps} steps/block x {args.repeats} rounds"
  )
  if serialized:
    print(
      "NOTE: the Controller serializes execution on CPU (serialize_execution): the two pods "
      "never compute at once,\nso a pods step is the SUM of both pods' work plus the exchange; "
      "on 2 cores 8 simulated devices share the cores anyway."
    )
  result = {
    "argv": sys.argv[1:],
    "model": model,
    **common.machine(),
    "steps_per_block": args.steps,
    "repeats": args.repeats,
    "serialized_execution": serialized,
  }
  sides, batches = {}, None
  try:
    if "throughput" in sections:
      print("\n== 1. throughput: 2 pods x 4 devices vs 1 island x 8 ==", flush=True)
      tp = throughput(args, model, variants, "")
      sides, batches = tp["sides"], tp["batches"]
      result["throughput"] = tp["rows"]
      print(f"[{time.perf_counter() - t_start:.0f}s]")
      print_throughput(tp["rows"])
    if "overlap" in sections:
      print("\n== 2. exchange overlap (traced step) ==", flush=True)
      if batches is None:
        batches = common.random_batches(common.load_config(args.config, {**model, **SINGLE}), 4)
      result["overlap"] = overlap_section(args, model, sides, batches)
      print(f"[{time.perf_counter() - t_start:.0f}s]")
      print_overlap(result["overlap"])
    for side in sides.values():
      side.close()
    if "loss" in sections:
      print(f"\n== 3. loss margins (palm_tiny, {args.train_steps} steps) ==", flush=True)
      result["loss"] = loss_section(args, workdir)
      print(f"[{time.perf_counter() - t_start:.0f}s]")
      print_loss(result["loss"], args)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  result["total_s"] = time.perf_counter() - t_start
  return result


if __name__ == "__main__":
  main()
