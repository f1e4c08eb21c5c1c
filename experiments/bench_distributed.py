"""Distributed mode, measured: a 2-stage pipeline as 2 processes that really run at once.

Run (about 20 minutes on 2 cores):
  python experiments/bench_distributed.py
  python experiments/bench_distributed.py --sections=pipeline --micro=4 --schedules=1f1b
  python experiments/bench_distributed.py --sections=memory,pods --steps=2
  python experiments/bench_distributed.py --sections=pipeline --stages=4 --micro=8

Each process is pinned to a core of its own (the single-process runs to one core) and holds one
simulated device per stage, so a process stands in for one accelerator and the two stages
compute concurrently on the machine's two cores; nothing is replayed or counted from the
schedule. `--stages=4` runs 4 processes, two to a core on this machine: no stand-in for 4
accelerators, reported as it is.

For each schedule (GPipe, 1F1B) and microbatch count M:
  single      one process, one device, the same model and global batch as one SPMD step with M
              microbatches accumulated (the work of the whole pipeline on one "accelerator")
  embedded    the 2-stage pipeline on 2 islands of one process (one device each): XLA:CPU runs
              one computation at a time there (see backend/controller.py), so no concurrency
  distributed the 2-stage pipeline, one stage per process (python -m pwtrain.launch style:
              loopback coordinator, cross-host transfers between the stages)
Reported: median seconds per step over --repeats blocks of --steps steps (after one warm-up
block), speedup single/distributed, the ideal S*M/(M+S-1) for S=2 stages, the fraction of it
reached (target >= 0.9), and distributed over embedded step time (the overhead of processes
and cross-host transfers against in-process transfers, on the same layout).

Each schedule runs at each parallel.stage_remat (`--stage_remats`): "full" recomputes a stage's
forward in its backward, "none" keeps the forward's residuals instead, so the stages do exactly
the single device's work.

Measured on 2 cores (`python experiments/bench_distributed.py --sections=pipeline`, 3 blocks of
3 steps, 8 rows per microbatch, load average 2.1), fraction of the bound:
  stage_remat  gpipe M=4  1f1b M=4  gpipe M=8  1f1b M=8
  full         0.93       0.90      0.90       0.85
  none         1.02       1.02      0.94       0.91
  distributed / embedded step time: 0.55-0.65 (embedded runs one computation at a time)
A second run at none (`--stage_remats=none`, load 2.2): 1f1b 0.97 / 0.97, gpipe 1.00 / 0.95 at
M=4 / 8. With `--remat=dots` (load 2.6): 1f1b full 0.93 / 0.85, none 0.97 / 0.89; gpipe full
0.96 / 0.90, none 0.99 / 0.91.
Above 1.0 at M=4: the single run itself is slower than the pipeline's pieces run one after
another (embedded, none: 1.394 s against single 1.487 s); against embedded, 1F1B none is 1.53x
(0.96 of the bound). At "full" a stage computes its forward twice per microbatch: by one traced
1F1B M=8 step (before stage_remat existed), stage 0 took F + B = 216 ms per microbatch against
the single device's 175 ms per stage and microbatch, a cap near 0.81, and every transfer
arrived 2-11 ms (median 3) after both sides issued it: compute, not transfers, held 1F1B back.
The transfers between the stages go by pull (backend/pulls.py): before b8a739d they were
cross-host device_puts, which JAX pairs by how many each process has issued, so they went from
one queue in program order and a receive waiting for its sender held back the sends behind it:
1F1B reached 0.90 / 0.56 at M=4 / 8 that way (GPipe 0.98 / 0.88, load 2.7), and 0.67 / 0.66
before c21650d (which issues a send before its island's next computation).

With --stages=4 --micro=8 --steps=2 --repeats=2 --stage_remats=full (4 processes on 2 cores,
load 3.7): GPipe
speedup 1.72 of bound 2.91 (0.59), 1F1B 1.60 (0.55); two cores cap the speedup at 2.0.

--sections=memory: for each schedule at the largest M, one more step of the distributed
pipeline traced on each process: the bytes of live arrays on the process's device (parameters,
optimizer state, and the activations and residuals kept between computations; not XLA's
temporaries inside one computation), sampled at every node's dispatch, launch and completion.
Reported per stage: before the step, the peak during it, and the difference.
--sections=pods: 2 data-parallel pods as 2 processes (one device each), exchange sync /
overlapped / stale: the median step time and, from one traced step on each process (launch and
completion stamps of its own computations, exact since they run one at a time, and of the
transfers it takes part in), the fraction of its pod's exchange work (gradients arriving from
the other pod, the reduction) started and finished before its last backward computation ended,
and the fraction of the exchange's run time before that moment ("hidden"), averaged over pods.

Measured (`--sections=memory --steps=2` and `--sections=pods`, transfers by pull): live bytes
before the step 22.9 MB per stage; peak at stage_remat full GPipe 39.9 / 39.9 MB, 1F1B 29.4 /
28.9 MB; at none (stage 0 keeps 91 MB of residuals per microbatch in flight: model.remat=none,
unrolled) GPipe 753.1 / 39.9 MB, 1F1B 207.7 / 28.9 MB (M=8); with `--remat=dots` GPipe 204.0 /
39.9 MB, 1F1B 70.4 / 28.9 MB. Pods hidden:
sync 0.00 (step 0.486 s, exchange 29.8 ms), overlapped 0.70 (0.571 s, 50.4 ms), stale 0.13
(0.507 s, 40.2 ms). With ordered device_puts (`--steps=2`): 1F1B 27.9 / 27.9 MB; sync 0.00
(0.645 s, 90.7 ms), overlapped 0.74 (0.776 s, 359.9 ms), stale 0.30 (0.624 s, 88.3 ms).

Caveat: 2 cores shared with the OS; each process also has Python threads (schedulers, the
coordination client), so the machine is slightly oversubscribed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = "--xla_force_host_platform_device_count={n} --xla_cpu_multi_thread_eigen=false"
MODEL = {
  **common.COMPARISON_MODEL,
  "data.seq_len": 128,
  "optim.name": "sgd",
  "optim.lr": 0.1,
  "optim.warmup_steps": 1,
  "train.num_steps": 1000,
}


def model(args) -> dict:
  """The benchmark's model at `--remat`."""
  return {**MODEL, "model.remat": args.remat}


def pipe(stages: int) -> dict:
  """A pipeline of `stages` stages, one island of one device each."""
  return {"parallel.islands": stages, "parallel.stages": stages, "parallel.devices_per_island": 1}


PODS = {
  "parallel.islands": 2,
  "parallel.pods": 2,
  "parallel.devices_per_island": 1,
  "train.global_batch": 16,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--micro", default="4,8", help="microbatch counts M")
  p.add_argument("--schedules", default="gpipe,1f1b")
  p.add_argument(
    "--stage_remats", default="full,none", help="parallel.stage_remat values (pipeline, memory)"
  )
  p.add_argument("--remat", default="none", help="model.remat of every run (single too)")
  p.add_argument("--stages", type=int, default=2, help="pipeline stages S, one process each")
  p.add_argument("--rows_per_micro", type=int, default=8, help="global batch = M x this")
  p.add_argument("--steps", type=int, default=3, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=3, help="timed blocks")
  p.add_argument("--sections", default="pipeline,memory,pods")
  p.add_argument("--exchanges", default="sync,overlapped,stale", help="pods section modes")
  p.add_argument("--out", default="")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # internal: a JSON job
  return p.parse_args(argv)


# -- one process's part -------------------------------------------------------------------------


def worker(job: dict) -> None:
  """Builds the job's step, runs a warm-up block and the timed blocks, then one traced step
  (job["trace"]: "memory" or "overlap"); each process writes its result to job["out"].<index>."""
  # One core per process (os.sched_setaffinity): XLA:CPU sizes its thread pool by the cores
  # it may use, and its flags do not pin it to one thread (measured: 2 cores busy either way).
  index = int(os.environ.get("PWTRAIN_PROCESS_ID", "0"))
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[index % len(os.sched_getaffinity(0))]})
  sys.path.insert(0, REPO)
  import ml_collections

  from pwtrain import config as config_lib
  from pwtrain.backend import distributed

  if job["nproc"] > 1:
    distributed.initialize(ml_collections.ConfigDict({"connect_timeout_s": 60}))
  import numpy as np

  from pwtrain.harness import Harness

  config = config_lib.load(os.path.join(REPO, "configs", "palm_tiny.py"), job["overrides"])
  trace = live_bytes_trace() if job.get("trace") else None
  harness = Harness.build(config, trace=trace)
  batch_shape = (config.train.global_batch, config.data.seq_len)
  rng = np.random.default_rng(0)
  batch = {
    "inputs": rng.integers(0, 256, batch_shape).astype(np.int32),
    "targets": rng.integers(0, 256, batch_shape).astype(np.int32),
  }
  state = harness.init()
  step, blocks = 0, []
  for block in range(job["repeats"] + 1):
    start = time.perf_counter()
    for _ in range(job["steps"]):
      out = harness.step(state, batch, step)
      state, step = out.state, step + 1
    out.metrics.result()  # the block's last step has finished (its metrics exist)
    harness.controller.wait()
    if block:  # the first block compiles nothing but warms caches and threads
      blocks.append((time.perf_counter() - start) / job["steps"])
  result = {"blocks": blocks}
  if trace is not None:  # one more step, alone, with its events and live bytes
    before = trace.reset_peak()
    last = len(trace.events)
    out = harness.step(state, batch, step)
    out.metrics.result()
    harness.controller.wait()
    events = trace.events[last:]
    deadline = time.monotonic() + 60  # transfers of carried values (stale) may still run
    while any(e.done is None for e in events) and time.monotonic() < deadline:
      time.sleep(0.01)
    result["live_bytes_before"] = before
    result["peak_live_bytes"] = trace.peak
    # This process's own computations and the transfers it takes part in, on the machine-wide
    # monotonic clock (time.perf_counter), so that the processes' events compare.
    t0 = trace.zero
    result["events"] = [
      {"name": e.name, "island": e.island, "launch": t0 + e.launch, "done": t0 + e.done}
      for e in events
      if e.launch is not None and e.done is not None
    ]
  harness.close()
  with open(f"{job['out']}.{index}", "w") as f:
    json.dump(result, f)


def live_bytes_trace():
  """A Trace that also samples the bytes of live arrays on this process's devices whenever it
  stamps a time (every node's dispatch, launch and completion), keeping the peak. These are the
  buffers the step holds between computations (parameters, optimizer state, activations and
  residuals kept for later microbatches); XLA's temporaries inside one computation are not
  arrays and are not counted. (XLA:CPU devices have no memory_stats.)"""
  import jax

  from pwtrain.backend import Trace

  def live_bytes() -> int:
    total = 0
    for array in jax.live_arrays():
      try:
        total += sum(s.data.nbytes for s in array.addressable_shards)
      except RuntimeError:  # deleted (donated) since the list was taken
        pass
    return total

  class LiveBytes(Trace):
    peak = 0

    @property
    def zero(self) -> float:
      """time.perf_counter() at this trace's time 0."""
      return self._t0

    def now(self) -> float:
      self.peak = max(self.peak, live_bytes())
      return super().now()

    def reset_peak(self) -> int:
      """Starts a new peak; the live bytes now."""
      self.peak = live_bytes()
      return self.peak

  return LiveBytes()


def run_job(nproc: int, overrides: dict, args, devices: int = 1, trace: str = "") -> list[dict]:
  """Each process's result (seconds per step of each timed block, and with `trace` the traced
  step's figures), from `nproc` processes of one device each (1: one process of `devices`
  devices, no distributed runtime)."""
  from pwtrain import launch

  out = tempfile.mktemp(suffix=".json")
  job = {"nproc": nproc, "overrides": overrides, "steps": args.steps, "repeats": args.repeats}
  job.update(out=out, trace=trace)
  port = launch.free_port()
  procs = []
  for i in range(nproc):
    env = launch.child_env(i, nproc, f"127.0.0.1:{port}", 1) if nproc > 1 else dict(os.environ)
    env["XLA_FLAGS"] = ONE_THREAD.format(n=1 if nproc > 1 else devices)
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, os.path.abspath(__file__), f"--worker={json.dumps(job)}"]
    procs.append(
      subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    )
  for p in procs:
    _, err = p.communicate(timeout=1200)
    if p.returncode:
      raise RuntimeError(f"a benchmark process failed:\n{err.decode()[-3000:]}")
  results = []
  for i in range(nproc):
    with open(f"{out}.{i}") as f:
      results.append(json.load(f))
    os.remove(f"{out}.{i}")
  return results


def layouts(args, base: dict):
  """(name, overrides) of the pipeline for every schedule and parallel.stage_remat asked for."""
  for schedule in args.schedules.split(","):
    for stage_remat in args.stage_remats.split(","):
      overrides = {"parallel.schedule": schedule, "parallel.stage_remat": stage_remat}
      yield f"{schedule} {stage_remat}", {**base, **pipe(args.stages), **overrides}


def pipeline_section(args) -> dict:
  rows, results = [], {}
  for m in [int(x) for x in args.micro.split(",")]:
    base = {**model(args), "train.global_batch": m * args.rows_per_micro}
    base["train.num_microbatches"] = m
    single = run_job(1, base, args)[0]["blocks"]
    for name, layout in layouts(args, base):
      embedded = run_job(1, layout, args, devices=args.stages)[0]["blocks"]
      dist = run_job(args.stages, {**layout, "backend.mode": "distributed"}, args)[0]["blocks"]
      s, e, d = (statistics.median(x) for x in (single, embedded, dist))
      bound = args.stages * m / (m + args.stages - 1)
      key = f"{name} M={m}"
      results[key] = {"single": single, "embedded": embedded, "distributed": dist}
      rows.append((name, m, s, e, d, s / d, bound, s / d / bound, d / e))
      print(f"  {key}: single {s:.3f} s, embedded {e:.3f} s, distributed {d:.3f} s", flush=True)
  print(f"\n{args.stages}-stage pipeline, one process per stage (median seconds per step):")
  print(
    "schedule stage_remat  M  single  embedded  distributed  speedup  bound  of bound  dist/emb"
  )
  for name, m, s, e, d, speedup, bound, frac, over in rows:
    print(
      f"{name:20s} {m:2d} {s:7.3f} {e:9.3f} {d:12.3f} {speedup:8.2f} {bound:6.2f} "
      f"{frac:9.2f} {over:9.2f}"
    )
  return results


def memory_section(args) -> dict:
  m = max(int(x) for x in args.micro.split(","))
  base = {**model(args), "train.global_batch": m * args.rows_per_micro}
  base["train.num_microbatches"] = m
  results = {}
  processes = f"{args.stages} processes, M={m}; MB = 2^20 bytes"
  print(f"\nPeak live bytes per stage during one step ({processes}):")
  print("schedule stage_remat  stage  before step  peak   peak - before")
  for name, layout in layouts(args, base):
    per_stage = run_job(
      args.stages, {**layout, "backend.mode": "distributed"}, args, trace="memory"
    )
    results[name] = per_stage
    for stage, r in enumerate(per_stage):
      before, peak = r["live_bytes_before"] / 2**20, r["peak_live_bytes"] / 2**20
      print(f"{name:20s} {stage:6d} {before:11.1f} {peak:6.1f} {peak - before:15.1f}")
  return results


def pods_section(args) -> dict:
  results = {}
  print("\n2 pods as 2 processes: exchange time hidden behind the backward (traced step):")
  print("exchange    step s  exchange ms  started before  finished before  hidden")
  for mode in args.exchanges.split(","):
    overrides = {**model(args), **PODS, "exchange.mode": mode, "backend.mode": "distributed"}
    per_pod = run_job(2, overrides, args, trace="overlap")
    overlap = exchange_overlap(per_pod)
    results[mode] = {"blocks": per_pod[0]["blocks"], **overlap}
    step = statistics.median(per_pod[0]["blocks"])
    print(
      f"{mode:10s} {step:7.3f} {overlap['exchange_ms']:12.1f} {overlap['started_before']:15.2f} "
      f"{overlap['finished_before']:16.2f} {overlap['hidden_time']:7.2f}"
    )
  return results


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
  if args.worker:
    worker(json.loads(args.worker))
    return
  sys.path.insert(0, REPO)
  sections = {"pipeline": pipeline_section, "memory": memory_section, "pods": pods_section}
  results = {name: sections[name](args) for name in args.sections.split(",")}
  load = os.getloadavg()[0]
  print(f"(load average {load:.1f} on {os.cpu_count()} cores)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
