"""Pipeline efficiency: GPipe and 1F1B over S islands vs the bubble bound and one data-parallel
island, for a sweep of microbatch counts M, in one run.

Run (8 simulated CPU devices; about 3 minutes on 2 cores):
  python experiments/bench_pipeline.py
  python experiments/bench_pipeline.py --stages=2 --microbatches=1,2,4 --out=/tmp/bp2.json
Options: --config (default palm_tiny), --set KEY=VALUE (any config key, repeatable,
applied to both sides), --stages, --microbatches, --schedules, --steps (per timed block),
--repeats, --compile_cache (a directory to keep compiled pieces between runs).

Model: palm_tiny widened to d_model 256 (d_ff 1024, 8 heads of 32, multi-query), 4 layers,
sequence 32, vocab 512. The global batch is FIXED at 16 sequences for every M (the same
optimisation problem and the same FLOPs per step; as M grows the microbatches shrink, so the
bubble shrinks while per-node overheads grow: the real trade-off). Islands are 8/S devices,
data-parallel inside (parallel.data=-1), so M must leave each island an even microbatch; M
values that do not are skipped with a note.

Measured, per schedule and M:
  step ms     pipelined step through the Controller (as pwtrain.train drives it: dispatch
              without waiting, backend.max_inflight_steps in flight), median over blocks;
  single ms   the same model and global batch as ONE island of all 8 devices (spmd step,
              data parallel, no microbatching); blocks alternate pipe, single, pipe, single...
              so that machine noise hits both alike;
  pipe/single throughput ratio = single ms / step ms.
  c_s         per-microbatch compute of stage s: F+B (B re-computes the forward), or FB on the
              last stage, timed in isolation: one step is run node by node in the program's
              order, blocking on each node (the "serial profile").
  eff         (M * sum_s c_s / S) / step ms: the fraction of the step an average island spends
              on microbatch compute. On S truly parallel islands with balanced stages and no
              overhead it approaches the bubble bound M / (M + S - 1).
  sim ms      the step replayed on S parallel islands: each node takes its isolated time and
              starts when its island's previous node and its inputs are done (transfers occupy
              their destination island, as the controller queues them there); sim eff uses
              sim ms. This is what the emitted schedule would achieve on real parallel
              hardware with this per-node cost, including stage imbalance, the end-of-step
              nodes (gradient sums, tied embedding, norm, optimizer) and transfer costs.
  serial ms   the sum of all the step's isolated node times; serial/step > 1 means the
              islands overlapped some work, < 1 means runtime overhead beyond compute.

Caveat: the "devices" are CPU devices simulated by XLA, and pwtrain's Controller runs one
computation at a time over all islands on CPU (serialize_execution, on by default there, against
XLA CPU collective deadlocks). Islands then never compute in parallel: the measured pipelined
step is the SUM of all stages' work, not the max, eff cannot exceed about 1/S, and the
pipe/single ratio reflects per-node overheads and matmul sizes, not the bubble.
--concurrent passes serialize_execution=False so that islands overlap, which only means
something with enough cores (e.g. 16 for 8 devices); on 2 cores they still share the cores.
What stays meaningful: the serial profile (per-stage cost and balance, per-node overheads as M
grows), the simulated efficiency against the bubble bound (does the emitted schedule reach
it?), GPipe vs 1F1B, and serial/step (does the runtime add overhead over bare compute?).
"""

import argparse
import os
import re
import statistics
import sys
import time

import common

common.force_host_devices(8)

import jax  # noqa: E402

from pwtrain.backend import Node, Transfer  # noqa: E402
from pwtrain.harness import Harness  # noqa: E402

MODEL = {
  "model.d_model": 256,
  "model.d_ff": 1024,
  "model.num_heads": 8,
  "model.head_dim": 32,
  "model.num_layers": 4,
  "data.seq_len": 32,
  "train.global_batch": 16,
}
COMPUTE = re.compile(r"(?:^|:)(FB|F|B)(\d+)\.(\d+)$")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  common.add_config_args(p)
  p.add_argument("--stages", type=int, default=4, help="S: stages, one island of 8/S devices each")
  p.add_argument("--microbatches", default="1,2,4,8", help="M values, comma-separated")
  p.add_argument("--schedules", default="gpipe,1f1b")
  p.add_argument("--steps", type=int, default=2, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=3, help="timed blocks per side and config")
  p.add_argument(
    "--profile_steps", type=int, default=2, help="serial-profile steps (min per node is kept)"
  )
  p.add_argument("--compile_cache", default=None, help="persistent compile cache directory")
  p.add_argument("--out", default="/tmp/bench_pipeline.json")
  p.add_argument(
    "--concurrent",
    action="store_true",
    help="Controller(serialize_execution=False): let islands run at once on CPU (needs cores)",
  )
  return p.parse_args(argv)


def make_side(config, batches, concurrent: bool) -> common.Side:
  """One compiled step program on its own Controller (islands overlap if `concurrent`)."""
  harness = Harness.build(config, serialize_execution=False if concurrent else None)
  return common.Side(harness, batches)


def simulate(program, times: dict) -> float:
  """Step time with islands in parallel: a node starts when its island is free and its inputs
  are done. Program order is a topological order that keeps each island's queue order."""
  done, free = {}, {}
  for node in program.nodes:
    refs = node.args if isinstance(node, Node) else (node.src,)
    ready = max([done[r[0]] for r in refs if not isinstance(r, str)], default=0.0)
    island, seconds = times[node.name]
    done[node.name] = max(ready, free.get(island, 0.0)) + seconds
    free[island] = done[node.name]
  return max(done.values())


def stage_costs(times: dict, num_stages: int) -> list[float]:
  """Per-microbatch compute of each stage (median over microbatches of F+B, or FB), seconds."""
  per = {}
  for name, (_, seconds) in times.items():
    m = COMPUTE.search(name)
    if m:
      key = (int(m.group(2)), int(m.group(3)))
      per[key] = per.get(key, 0.0) + seconds
  costs = [statistics.median(v for (s, _), v in per.items() if s == st) for st in range(num_stages)]
  return costs


def kind_costs(times: dict, num_stages: int) -> list[dict]:
  """Per stage: median ms of each compute kind (F, B, FB per microbatch; the rest per step)."""
  per = [{} for _ in range(num_stages)]
  for name, (_, seconds) in times.items():
    m = COMPUTE.search(name) or re.search(r"(?:^|:)(zeros|emb|finish|reduce|enc|apply)(\d+)$", name)
    if m and int(m.group(2)) < num_stages:
      per[int(m.group(2))].setdefault(m.group(1), []).append(seconds * 1e3)
  return [{k: statistics.median(v) for k, v in sorted(d.items())} for d in per]


def main(argv=None):
  args = parse_args(argv)
  load = common.Load()
  # Pieces that do not depend on the schedule or M (init, optimizer update, ...) compile once.
  with common.compile_cache(args.compile_cache, "bench_pipeline_cache_"):
    return _main(args, load)


def _main(args, load):
  num_stages, num_devices = args.stages, len(jax.devices())
  micros = [int(m) for m in args.microbatches.split(",")]
  schedules = args.schedules.split(",")
  model = {**MODEL, **common.parse_sets(args.set)}
  t_start = time.perf_counter()

  single_config = common.load_config(
    args.config,
    {
      **model,
      "parallel.islands": 1,
      "parallel.stages": 1,
      "parallel.data": -1,
      "train.num_microbatches": 1,
    },
  )
  batches = common.random_batches(single_config, 4)
  single = make_side(single_config, batches, args.concurrent)
  serialized = not args.concurrent and jax.devices()[0].platform == "cpu"
  single.run(2)  # warm up
  gb, seq = single_config.train.global_batch, single_config.data.seq_len
  print(
    f"model d_model={single_config.model.d_model} layers={single_config.model.num_layers} "
    f"seq={seq} global_batch={gb} (fixed); {num_devices} {jax.devices()[0].platform} devices; "
    f"single island: {single.harness.compile_s:.1f}s to compile"
  )
  how = (
    "the Controller serializes execution on CPU: islands never run at once"
    if serialized
    else "islands may run at once (--concurrent)"
  )
  print(
    f"NOTE: {num_devices} simulated devices on {os.cpu_count()} CPU cores; {how}. See the "
    "module docstring for what the numbers mean."
  )

  rows = []
  for micro in micros:
    for schedule in schedules:
      layout = {
        "parallel.islands": num_stages,
        "parallel.stages": num_stages,
        "parallel.data": -1,
        "parallel.schedule": schedule,
        "train.num_microbatches": micro,
      }
      try:  # config checks, then the plan's divisibility checks
        pipe = make_side(
          common.load_config(args.config, {**model, **layout}), batches, args.concurrent
        )
      except ValueError as e:
        print(f"skip {schedule} M={micro}: {e}")
        continue
      pipe.run(1)  # warm up
      # Each node's isolated time: the least over a few profiled steps (noise only adds).
      runs = [pipe.profile() for _ in range(args.profile_steps)]
      times = {k: (v[0], min(r[k][1] for r in runs)) for k, v in runs[0].items()}
      pipe_blocks, single_blocks = [], []
      for _ in range(args.repeats):
        pipe_blocks.append(pipe.run(args.steps))
        single_blocks.append(single.run(args.steps))
      pipe.close()
      costs = stage_costs(times, num_stages)
      step, one = statistics.median(pipe_blocks), statistics.median(single_blocks)
      sim = simulate(pipe.step_program.program, times)
      work = micro * sum(costs) / num_stages
      serial = sum(s for _, s in times.values())
      xfer = sum(s for n, (_, s) in times.items() if n in _transfers(pipe.step_program.program))
      row = {
        "schedule": schedule,
        "stages": num_stages,
        "microbatches": micro,
        "microbatch_size": gb // micro,
        "compile_s": pipe.harness.compile_s,
        "step_ms": step * 1e3,
        "single_ms": one * 1e3,
        "throughput_ratio": one / step,
        "stage_ms": [c * 1e3 for c in costs],
        "stage_kind_ms": kind_costs(times, num_stages),
        "efficiency": work / step,
        "sim_ms": sim * 1e3,
        "sim_efficiency": work / sim,
        "bubble_bound": micro / (micro + num_stages - 1),
        "serial_ms": serial * 1e3,
        "serial_over_step": serial / step,
        "transfer_ms": xfer * 1e3,
        "num_nodes": len(times),
        "step_blocks_ms": [b * 1e3 for b in pipe_blocks],
        "single_blocks_ms": [b * 1e3 for b in single_blocks],
      }
      rows.append(row)
      print(
        f"{schedule:5} M={micro:<2} step {row['step_ms']:7.1f} ms  single {row['single_ms']:6.1f} "
        f"ms  stage ms/microbatch {[round(c, 1) for c in row['stage_ms']]}  compile "
        f"{pipe.harness.compile_s:.1f}s  [{time.perf_counter() - t_start:.0f}s]",
        flush=True,
      )
  single.close()

  print()
  header = (
    f"{'schedule':8} {'S':>2} {'M':>3} {'mb':>3} {'step ms':>8} {'single ms':>9} "
    f"{'pipe/single':>11} {'eff':>5} {'sim ms':>7} {'sim eff':>7} {'bound':>5} "
    f"{'serial ms':>9} {'serial/step':>11} {'xfer ms':>7}"
  )
  print(header)
  print("-" * len(header))
  for r in rows:
    print(
      f"{r['schedule']:8} {r['stages']:>2} {r['microbatches']:>3} {r['microbatch_size']:>3} "
      f"{r['step_ms']:8.1f} {r['single_ms']:9.1f} {r['throughput_ratio']:11.2f} "
      f"{r['efficiency']:5.2f} {r['sim_ms']:7.1f} {r['sim_efficiency']:7.2f} "
      f"{r['bubble_bound']:5.2f} {r['serial_ms']:9.1f} {r['serial_over_step']:11.2f} "
      f"{r['transfer_ms']:7.1f}"
    )
  print(
    "eff = (M * sum_s c_s / S) / step ms, c_s = stage s's isolated F+B (or FB) time per "
    "microbatch;\nsim = the step replayed on S parallel islands with isolated node times; "
    "bound = M/(M+S-1);\nserial = sum of the step's isolated node times (islands cannot overlap "
    "on this CPU, so serial/step ~ 1 means little runtime overhead)."
  )
  result = {
    "argv": sys.argv[1:],
    "config": args.config,
    "model": model,
    **common.machine(),
    **load.report(),
    "steps_per_block": args.steps,
    "repeats": args.repeats,
    "single_compile_s": single.harness.compile_s,
    "concurrent": args.concurrent,
    # pwtrain's Controller serializes execution on CPU by default (see the docstring).
    "serialized_execution": serialized,
    "rows": rows,
  }
  print(f"[{time.perf_counter() - t_start:.0f}s]")
  common.write_json(args.out, result)
  return result


def _transfers(program) -> set:
  return {n.name for n in program.nodes if isinstance(n, Transfer)}


if __name__ == "__main__":
  main()
