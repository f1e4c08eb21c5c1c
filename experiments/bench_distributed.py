"""Distributed mode, measured: pipelines and pods as processes that really run at once, and what
each process compiles.

Run (about 45 minutes on 2 cores):
  python experiments/bench_distributed.py
  python experiments/bench_distributed.py --sections=pipeline --micro=4 --schedules=1f1b
  python experiments/bench_distributed.py --sections=memory,pods --steps=2
  python experiments/bench_distributed.py --sections=pipeline --stages=4 --micro=8
  python experiments/bench_distributed.py --sections=compile
  python experiments/bench_distributed.py --sections=pipeline --micro=4 --layers=8 --virtual=4 \
    --schedules=1f1b,interleaved

Each process is pinned to a core of its own (one-process runs to the first core) and holds one
simulated device per stage, so a process stands in for one accelerator and the stages compute
concurrently on the machine's cores; nothing is replayed or counted from the schedule.
`--stages=4` runs 4 processes, two to a core on a 2-core machine: no stand-in for 4
accelerators, reported as it is. Every side's processes start once, build their step, and then
run blocks of --steps steps on command (experiments/distributed_sides.py).

--sections=pipeline. For each microbatch count M, every side below is started, each runs one
warm-up block, and then --repeats rounds (at least 5 for a quotable figure) each run one block
of every side, one side at a time, in an order rotated by one each round: the sides are
interleaved block by block, so a slow stretch of a shared machine falls on all of them.
Reported: the median seconds per step of each side, and for each schedule (--schedules) and
parallel.stage_remat (--stage_remats):
  single       one process, one device, the same model and global batch as one SPMD step with
               M microbatches accumulated: the whole step on one "accelerator"
  serial       the same pipeline's pieces, run one after another in one process (embedded mode,
               one island of one device per stage: XLA:CPU runs one computation at a time there,
               see backend/controller.py)
  distributed  the pipeline, one stage per process (loopback coordinator; transfers between the
               stages by pull, backend/pulls.py)
  bound        the schedule's own bound on the speedup, printed with where it comes from
               (BOUNDS): S*M/(M+S-1) for GPipe and 1F1B
and the speedup of distributed over each reference with the fraction of the bound it reaches.
"stage_remat=full" recomputes a stage's forward in its backward, so its pieces add up to more
than the single device's work; at "none" they keep the forward's residuals and do the single
device's work. The bound is against the pieces' own work (serial); against single it holds
where the pieces add up to the single device's work.

--sections=memory: for each schedule at the largest M, one more step of the distributed
pipeline traced on each process: the bytes of live arrays on the process's device (parameters,
optimizer state, and the activations and residuals kept between computations; not XLA's
temporaries inside one computation), sampled at every node's dispatch, launch and completion.
Reported per stage: before the step, the peak during it, and the difference.
--sections=pods: 2 data-parallel pods as 2 processes (one device each), exchange sync /
overlapped / stale, interleaved as the pipeline's sides: the median step time and, from one
traced step on each process (launch and completion stamps of its own computations, exact since
they run one at a time, and of the transfers it takes part in), the fraction of its pod's
exchange work (gradients arriving from the other pod, the reduction) started and finished before
its last backward computation ended, and the fraction of the exchange's run time before that
moment ("hidden"), averaged over pods.
--sections=compile: a --compile_stages-stage pipeline (default 4) as that many processes, built
--compile_repeats times each way, alternately: every process compiling every island's pieces
(Controller(compile_everywhere=True): what every process did before it traced other processes'
pieces to outlines, backend/outline.py), and each compiling only its own islands' pieces (the
default). Reported per process (the median over the builds): the build's wall and CPU seconds
(Harness.compile_s and the process's CPU time: 4 processes on 2 cores share them), and the
Controller.compile calls' seconds by what they compiled: the stage pieces (F, B, FB) and the
others, of this process's island and of the others. The two ways' first-block losses must be
equal (the same programs run).

Measured figures, with their commands and the machine's load, are in docs/benchmarks.md
("Distributed mode"). Caveat: 2 cores shared with the OS; each process also has Python threads
(schedulers, the coordination client), so the machine is slightly oversubscribed.
"""

import argparse
import json
import os
import statistics
import sys
import types

import common
from distributed_sides import Side

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = {
  **common.COMPARISON_MODEL,
  "data.seq_len": 128,
  "optim.name": "sgd",
  "optim.lr": 0.1,
  "optim.warmup_steps": 1,
  "train.num_steps": 1000,
}

# Each schedule's bound on a pipeline's speedup: (bound(S, M), where it comes from).
FILL_AND_DRAIN = (
  "with every stage's forward and backward of one length per microbatch, a stage is busy in M "
  "of the M+S-1 slots of the forward sweep and of the backward sweep: the pipeline's fill and "
  "drain (GPipe, Huang et al. 2019); 1F1B runs the same slots in another order, keeping fewer "
  "microbatches in flight, and idles as long (PipeDream-Flush, Narayanan et al. 2021)"
)
VIRTUAL = [2]  # the interleaved schedule's parallel.virtual_stages (--virtual)


def _counted(schedule: str):
  """S / the step over a stage's work, counted from `schedule` by pwtrain's own schedule with a
  forward, an input-gradient and a weight-gradient piece of 1, 1 and 1 (a backward of 2)."""

  def bound(s: int, m: int) -> float:
    from pwtrain.parallel.pipeline import schedule as schedule_lib
    from pwtrain.parallel.stages import Stage

    virtual = VIRTUAL[0] if schedule == "interleaved" else 1
    chunks = [Stage(c, c, c + 1, c == 0, c == s * virtual - 1) for c in range(s * virtual)]
    return s / schedule_lib.bubble(schedule, chunks, m, virtual)

  return bound


BOUNDS = {
  "gpipe": (lambda s, m: s * m / (m + s - 1), "S*M/(M+S-1): " + FILL_AND_DRAIN),
  "1f1b": (lambda s, m: s * m / (m + s - 1), "S*M/(M+S-1): " + FILL_AND_DRAIN),
  "interleaved": (
    lambda s, m: s * VIRTUAL[0] * m / (VIRTUAL[0] * m + s - 1),
    "S*v*M/(v*M+S-1), v=--virtual: each island's fill and drain take a chunk's pieces, 1/v of "
    "a stage's (Megatron's interleaved 1F1B, Narayanan et al. 2021)",
  ),
  "zero_bubble": (
    _counted("zero_bubble"),
    "S / the step over a stage's work counted from the schedule with F, B, W = 1, 1, 1 (the "
    "split backward's input and weight gradients; transfers free): a count, not a law",
  ),
}


def bound(schedule: str, stages: int, micro: int) -> float:
  """The schedule's bound on the speedup (BOUNDS); nan for a schedule with none known here."""
  return BOUNDS[schedule][0](stages, micro) if schedule in BOUNDS else float("nan")


def model(args) -> dict:
  """The benchmark's model at `--remat`."""
  layers = {"model.num_layers": args.layers} if args.layers else {}
  return {**MODEL, "model.remat": args.remat, **layers}


def pipe(stages: int) -> dict:
  """A pipeline of `stages` stages, one island of one device each."""
  return {"parallel.islands": stages, "parallel.stages": stages, "parallel.devices_per_island": 1}


PODS = {
  "parallel.islands": 2,
  "parallel.pods": 2,
  "parallel.devices_per_island": 1,
  "train.global_batch": 16,
}
DISTRIBUTED = {"backend.mode": "distributed"}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--micro", default="4,8", help="microbatch counts M")
  p.add_argument("--schedules", default="gpipe,1f1b,zero_bubble,interleaved")
  p.add_argument(
    "--stage_remats", default="full,none", help="parallel.stage_remat values (pipeline, memory)"
  )
  p.add_argument("--remat", default="none", help="model.remat of every run (single too)")
  p.add_argument("--stages", type=int, default=2, help="pipeline stages S, one process each")
  p.add_argument("--virtual", type=int, default=2, help="interleaved: parallel.virtual_stages")
  p.add_argument("--layers", type=int, default=0, help="model.num_layers (0: the model's 4)")
  p.add_argument("--rows_per_micro", type=int, default=8, help="global batch = M x this")
  p.add_argument("--steps", type=int, default=3, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=5, help="timed blocks per side (interleaved)")
  p.add_argument("--sections", default="pipeline,memory,pods,compile")
  p.add_argument("--exchanges", default="sync,overlapped,stale", help="pods section modes")
  p.add_argument("--compile_stages", type=int, default=4, help="compile section: S processes")
  p.add_argument("--compile_repeats", type=int, default=2, help="compile section: builds each way")
  p.add_argument("--out", default="")
  return p.parse_args(argv)


def interleaved(sides: dict[str, Side], repeats: int) -> dict[str, list[float]]:
  """{side: seconds per step of each of its `repeats` blocks} (process 0's clock): one warm-up
  block of every side, not kept, then `repeats` rounds of one block per side, one side at a
  time, in an order rotated by one each round, so that no side always follows the same one."""
  names = list(sides)
  for name in names:
    sides[name].ask("block")
  blocks = {name: [] for name in names}
  for r in range(repeats):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      blocks[name].append(sides[name].ask("block")[0]["seconds"])
  return blocks


def start(sides: dict, name: str, *args, **kwargs) -> None:
  """sides[name] = Side(name, *args, **kwargs), the sides started so far closed if it fails."""
  try:
    sides[name] = Side(name, *args, **kwargs)
  except BaseException:
    close(sides)
    raise


def close(sides: dict) -> None:
  for side in sides.values():
    side.close()


def layouts(args, base: dict):
  """(name, schedule, overrides) of the pipeline for every schedule and stage_remat asked for."""
  for schedule in args.schedules.split(","):
    for stage_remat in args.stage_remats.split(","):
      overrides = {"parallel.schedule": schedule, "parallel.stage_remat": stage_remat}
      if schedule == "interleaved":
        overrides["parallel.virtual_stages"] = VIRTUAL[0]
      yield f"{schedule} {stage_remat}", schedule, {**base, **pipe(args.stages), **overrides}


def pipeline_section(args) -> dict:
  rows, results, stages = [], {}, args.stages
  for m in [int(x) for x in args.micro.split(",")]:
    base = {**model(args), "train.global_batch": m * args.rows_per_micro}
    base["train.num_microbatches"] = m
    sides: dict[str, Side] = {}
    start(sides, "single", 1, base, args.steps)
    for name, _, layout in layouts(args, base):
      start(sides, f"{name} serial", 1, layout, args.steps, devices=stages)
      start(sides, f"{name} distributed", stages, {**layout, **DISTRIBUTED}, args.steps)
    print(f"  M={m}: {len(sides)} sides built; {args.repeats} interleaved blocks", flush=True)
    try:
      blocks = interleaved(sides, args.repeats)
    finally:
      close(sides)
    single = statistics.median(blocks["single"])
    for name, schedule, _ in layouts(args, base):
      serial = statistics.median(blocks[f"{name} serial"])
      dist = statistics.median(blocks[f"{name} distributed"])
      results[f"{name} M={m}"] = {
        "single": blocks["single"],
        "serial": blocks[f"{name} serial"],
        "distributed": blocks[f"{name} distributed"],
      }
      spread = spread_of(blocks[f"{name} distributed"])
      rows.append((name, m, single, serial, dist, bound(schedule, stages, m), spread))
  print(
    f"\n{stages}-stage pipeline, one process per stage: median seconds per step over "
    f"{args.repeats} interleaved blocks of {args.steps} steps"
  )
  print(
    "schedule stage_remat  M  single  serial  distributed (spread)  bound  "
    "single/dist (of bound)  serial/dist (of bound)"
  )
  for name, m, single, serial, dist, b, spread in rows:
    print(
      f"{name:20s} {m:2d} {single:7.3f} {serial:7.3f} {dist:12.3f} ({spread:4.2f}) {b:6.2f} "
      f"{single / dist:11.2f} ({single / dist / b:4.2f}) {serial / dist:11.2f} "
      f"({serial / dist / b:4.2f})"
    )
  print(
    "single: the whole step on one device; serial: the same pieces one after another in one "
    "process; spread: (max - min) / median of the distributed blocks. Bounds:"
  )
  explained: dict[str, list[str]] = {}
  for schedule in args.schedules.split(","):
    why = BOUNDS[schedule][1] if schedule in BOUNDS else "none known here"
    explained.setdefault(why, []).append(schedule)
  for why, schedules in explained.items():
    print(f"  {', '.join(schedules)}: {why}")
  return results


def spread_of(blocks: list[float]) -> float:
  return (max(blocks) - min(blocks)) / statistics.median(blocks)


def memory_section(args) -> dict:
  m = max(int(x) for x in args.micro.split(","))
  base = {**model(args), "train.global_batch": m * args.rows_per_micro}
  base["train.num_microbatches"] = m
  results = {}
  processes = f"{args.stages} processes, M={m}; MB = 2^20 bytes"
  print(f"\nPeak live bytes per stage during one step ({processes}):")
  print("schedule stage_remat  stage  before step  peak   peak - before")
  for name, _, layout in layouts(args, base):
    side = Side(name, args.stages, {**layout, **DISTRIBUTED}, args.steps, trace="memory")
    try:
      side.ask("block")  # warm-up
      per_stage = side.ask("trace")
    finally:
      side.close()
    results[name] = per_stage
    for stage, r in enumerate(per_stage):
      before, peak = r["live_bytes_before"] / 2**20, r["peak_live_bytes"] / 2**20
      print(f"{name:20s} {stage:6d} {before:11.1f} {peak:6.1f} {peak - before:15.1f}")
  return results


def pods_section(args) -> dict:
  sides: dict[str, Side] = {}
  for mode in args.exchanges.split(","):
    overrides = {**model(args), **PODS, "exchange.mode": mode, **DISTRIBUTED}
    start(sides, mode, 2, overrides, args.steps, trace="overlap")
  try:
    blocks = interleaved(sides, args.repeats)
    traced = {mode: side.ask("trace") for mode, side in sides.items()}
  finally:
    close(sides)
  results = {}
  print("\n2 pods as 2 processes: exchange time hidden behind the backward (traced step):")
  print("exchange    step s  exchange ms  started before  finished before  hidden")
  for mode, per_pod in traced.items():
    overlap = exchange_overlap(per_pod)
    results[mode] = {"blocks": blocks[mode], **overlap}
    step = statistics.median(blocks[mode])
    print(
      f"{mode:10s} {step:7.3f} {overlap['exchange_ms']:12.1f} {overlap['started_before']:15.2f} "
      f"{overlap['finished_before']:16.2f} {overlap['hidden_time']:7.2f}"
    )
  return results


def compile_section(args) -> dict:
  stages, m = args.compile_stages, max(int(x) for x in args.micro.split(","))
  results = {}
  for stage_remat in args.stage_remats.split(","):
    overrides = {**model(args), **pipe(stages), **DISTRIBUTED, "train.num_microbatches": m}
    overrides.update({"train.global_batch": m * args.rows_per_micro})
    overrides["parallel.stage_remat"] = stage_remat
    results[stage_remat] = builds = compile_builds(args, overrides)
    print(
      f"\n{stages}-stage pipeline on {stages} processes, M={m}, stage_remat={stage_remat}: "
      f"compile seconds per process, CPU (wall), median of {args.compile_repeats} build(s)"
    )
    print_compiles(builds, stages)
  return results


def print_compiles(builds: dict, stages: int) -> None:
  def median(way, process, key):
    return statistics.median(b["processes"][process].get(key, 0.0) for b in builds[way])

  def cell(way, process, key):
    cpu, wall = (median(way, process, f"{key}_{clock}_s") for clock in ("cpu", "wall"))
    return f"{cpu:7.2f} ({wall:7.2f})"

  print(f"{'':17s}{'':19s}{'stage pieces (F, B, FB)':^38s}{'other pieces':^38s}")
  print(
    f"{'way':12s}{'process':>8s}{'build':>16s}{'own island':>19s}{'others':>19s}"
    f"{'own island':>19s}{'others':>19s}"
  )
  keys = ("compile", "stage_here", "stage_elsewhere", "other_here", "other_elsewhere")
  for way in builds:
    for i in range(stages):
      print(f"{way:12s}{i:8d}" + "".join(f"{cell(way, i, k):>19s}" for k in keys))
  for what, parts in (("build", ("compile",)), ("stage pieces", keys[1:3])):
    ratios = [
      sum(median("own islands", i, f"{k}_cpu_s") for k in parts)
      / sum(median("everywhere", i, f"{k}_cpu_s") for k in parts)
      for i in range(stages)
    ]
    print(
      f"own islands / everywhere, {what} CPU per process: "
      + ", ".join(f"{r:.2f}" for r in ratios)
      + f" (1/S = {1 / stages:.2f})"
    )
  compiled = [median("own islands", i, "stage_elsewhere_compiled") for i in range(stages)]
  print(f"other islands' stage pieces compiled anyway (a sharding left to XLA): {compiled}")


def compile_builds(args, overrides: dict) -> dict:
  """{way: [per build {"processes": each process's build report, "loss": [each process's
  first-block loss]}]}: --compile_repeats builds each way, the ways alternating; the losses
  must be the same both ways."""
  ways = {"everywhere": True, "own islands": False}  # Controller's compile_everywhere
  builds = {way: [] for way in ways}
  for r in range(args.compile_repeats):
    for way in list(ways)[r % 2 :] + list(ways)[: r % 2]:
      side = Side(way, args.compile_stages, overrides, 1, compile_everywhere=ways[way])
      try:
        losses = [a["loss"] for a in side.ask("block")]
      finally:
        side.close()
      builds[way].append({"processes": side.ready, "loss": losses})
      print(f"  built {way} ({r + 1}/{args.compile_repeats})", flush=True)
  losses = {tuple(b["loss"]) for runs in builds.values() for b in runs}
  assert len(losses) == 1, f"the builds' losses differ: {builds}"
  print(f"  first-block loss of every build and process: {next(iter(losses))[0]}")
  return builds


def exchange_overlap(per_process: list[dict]) -> dict:
  """common.exchange_overlap over the pods' merged events. A gradient transfer q>p is traced on
  both processes: it starts when both sides have issued it (the sender once the gradient is
  computed; the receiver may post it earlier) and ends when the receiver has the data (the
  later done). A computation is traced on its own process only."""
  sides: dict = {}
  for events in (r["events"] for r in per_process):
    for e in events:
      sides.setdefault(e["name"], []).append(e)
  merged = [
    types.SimpleNamespace(
      name=name,
      island=copies[0]["island"],
      launch=max(c["launch"] for c in copies),
      done=max(c["done"] for c in copies),
    )
    for name, copies in sides.items()
  ]
  return common.exchange_overlap(merged, serialized=True)


def main(argv=None) -> None:
  args = parse_args(argv)
  VIRTUAL[0] = args.virtual
  sys.path.insert(0, REPO)
  sections = {
    "pipeline": pipeline_section,
    "memory": memory_section,
    "pods": pods_section,
    "compile": compile_section,
  }
  load = common.Load()
  results = {name: sections[name](args) for name in args.sections.split(",")}
  results["load"] = load.report()
  print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
