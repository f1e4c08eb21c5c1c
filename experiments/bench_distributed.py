"""Distributed mode, measured: a 2-stage pipeline as 2 processes that really run at once.

Run (about 10 minutes on 2 cores):
  python experiments/bench_distributed.py
  python experiments/bench_distributed.py --micro=4 --schedules=1f1b --steps=3 --out=/tmp/bd.json

Each process is pinned to a core of its own (the single-process runs to one core) and holds one
simulated device per stage, so a process stands in for one accelerator and the two stages
compute concurrently on the machine's two cores; nothing is replayed or counted from the
schedule.

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

Measured on 2 cores (`python experiments/bench_distributed.py`, 3 blocks of 3 steps, 8 rows
per microbatch):
  gpipe M=4: speedup 1.32 of bound 1.60 (0.83); 1f1b M=4: 1.08 (0.67)
  gpipe M=8: speedup 1.53 of bound 1.78 (0.86); 1f1b M=8: 1.17 (0.66)
  distributed / embedded step time: 0.63-0.95 (embedded runs one computation at a time)
1F1B falls further short because its sends and receives alternate, and the transfers between
two processes go from one queue in program order on each side, so a receive still waiting for
its data holds back the next send. (A queue per side, sends apart from receives, hung in a
trial here; why is not yet understood.)

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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = "--xla_force_host_platform_device_count={n} --xla_cpu_multi_thread_eigen=false"
MODEL = {
  "model.num_layers": 4,
  "model.d_model": 256,
  "model.num_heads": 8,
  "model.num_kv_heads": 1,
  "model.head_dim": 32,
  "model.d_ff": 1024,
  "data.seq_len": 128,
  "optim.name": "sgd",
  "optim.lr": 0.1,
  "optim.warmup_steps": 1,
  "train.num_steps": 1000,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--micro", default="4,8", help="microbatch counts M")
  p.add_argument("--schedules", default="gpipe,1f1b")
  p.add_argument("--rows_per_micro", type=int, default=8, help="global batch = M x this")
  p.add_argument("--steps", type=int, default=3, help="steps per timed block")
  p.add_argument("--repeats", type=int, default=3, help="timed blocks")
  p.add_argument("--out", default="")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # internal: a JSON job
  return p.parse_args(argv)


# -- one process's part -------------------------------------------------------------------------


def worker(job: dict) -> None:
  """Builds the job's step, runs a warm-up block and the timed blocks; process 0 writes the
  seconds per step of each block to job["out"]."""
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
  import jax
  import numpy as np

  from pwtrain.harness import Harness

  config = config_lib.load(os.path.join(REPO, "configs", "palm_tiny.py"), job["overrides"])
  harness = Harness.build(config)
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
  harness.close()
  if jax.process_index() == 0:
    with open(job["out"], "w") as f:
      json.dump(blocks, f)


def run_job(nproc: int, overrides: dict, args, devices: int = 1) -> list[float]:
  """Seconds per step of each timed block, from `nproc` processes of one device each (1: one
  process of `devices` devices, no distributed runtime)."""
  from pwtrain import launch

  out = tempfile.mktemp(suffix=".json")
  job = {"nproc": nproc, "overrides": overrides, "steps": args.steps, "repeats": args.repeats}
  job["out"] = out
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
  with open(out) as f:
    return json.load(f)


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.worker:
    worker(json.loads(args.worker))
    return
  sys.path.insert(0, REPO)
  rows, results = [], {}
  for m in [int(x) for x in args.micro.split(",")]:
    base = {**MODEL, "train.global_batch": m * args.rows_per_micro, "train.num_microbatches": m}
    single = run_job(1, base, args)
    for schedule in args.schedules.split(","):
      pipe = {
        **base,
        "parallel.islands": 2,
        "parallel.stages": 2,
        "parallel.schedule": schedule,
        "parallel.devices_per_island": 1,
      }
      embedded = run_job(1, pipe, args, devices=2)
      dist = run_job(2, {**pipe, "backend.mode": "distributed"}, args)
      s, e, d = (statistics.median(x) for x in (single, embedded, dist))
      bound = 2 * m / (m + 1)
      key = f"{schedule} M={m}"
      results[key] = {"single": single, "embedded": embedded, "distributed": dist}
      rows.append((schedule, m, s, e, d, s / d, bound, s / d / bound, d / e))
      print(f"  {key}: single {s:.3f} s, embedded {e:.3f} s, distributed {d:.3f} s", flush=True)
  print("\n2-stage pipeline, one process per stage (median seconds per step):")
  print("schedule  M  single  embedded  distributed  speedup  bound  of bound  dist/embedded")
  for schedule, m, s, e, d, speedup, bound, frac, over in rows:
    print(
      f"{schedule:8s} {m:2d} {s:7.3f} {e:9.3f} {d:12.3f} {speedup:8.2f} {bound:6.2f} "
      f"{frac:9.2f} {over:14.2f}"
    )
  load = os.getloadavg()[0]
  print(f"(load average {load:.1f} on {os.cpu_count()} cores)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
