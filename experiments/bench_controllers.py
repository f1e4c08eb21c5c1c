"""Single controller against multi-controller (issue 29, in the style of the Pathways paper's
Figure 5): the same 2-island work run by pwtrain's two multi-process designs, at three sizes of
the work one node computes.

Run (about 45 minutes on a quiet 2-core machine, estimated from smoke runs):
  python experiments/bench_controllers.py
  python experiments/bench_controllers.py --sizes=small --layouts=pipeline --blocks=1 --steps=5
  python experiments/bench_controllers.py --out=/tmp/bench_controllers.json

Modes, each a real training run of `pwtrain.main` in a subprocess (built-in corpus, data.max_files
--max_files, byte tokenizer, SGD, no evaluation, one checkpoint at the end, untimed):
  remote       `python -m pwtrain.main ... --config.backend.mode=remote
               --config.backend.launch_workers=True`: one controller process walks every step's
               program and drives one gRPC island worker per island, which the run starts on
               127.0.0.1 (single controller).
  distributed  `python -m pwtrain.launch --nproc=2 --devices_per_process=1 -- ...`: one process
               per island, every process walks the program and launches its own island's nodes
               (multi-controller; transfers between the islands by pull).
Layouts (2 islands of one simulated CPU device each, parallel.devices_per_island=1):
  pipeline     parallel.stages=2, 1F1B, --micro microbatches (default 4), stage_remat full (the
               default, and the only one remote mode allows)
  pods         parallel.pods=2, exchange.mode sync, data.streams=2
Sizes (4 layers, 8 heads with one key/value head, head_dim d_model/8, d_ff 4 d_model, vocab 512;
rows are per microbatch (pipeline) or per pod (pods)):
  size    d_model  pipeline seq x rows  pods seq x rows  node (CPU time, one core)
  small   128      64 x 1               32 x 1           pipeline ~5 ms, pods ~7 ms
  medium  256      128 x 2              128 x 1          pipeline ~50 ms, pods ~56 ms
  large   512      256 x 3              320 x 1          pipeline ~500 ms, pods ~500 ms
"node" is one work node of the step: pipeline stage 0's forward (F) and backward (B, which
recomputes the forward at stage_remat full) and stage 1's forward+loss+backward (FB) of one
microbatch, reported as the median over the step's F, B and FB nodes (F is about a third of B);
pods: a pod's forward+backward of its rows (FB). The sizes were chosen from each node's CPU time
(time.process_time around the compiled executable, one device, one XLA thread, embedded mode),
which a loaded machine inflates less than wall time. The benchmark measures the node time again
on the machine it runs on: before the timed blocks of each (layout, size) it runs one short
distributed run with backend.trace=True and reports the median wall span of the work nodes of
its steps after the first (each span from the later of the node's launch and the end of the
previous node on its island, to its completion; trace.json of both processes).

Cores: every island process (a remote worker, a distributed process) is pinned to one core of
its own (os.sched_setaffinity to core i of those allowed for island or process i, as in
bench_distributed.py), from a sitecustomize.py this benchmark puts on the children's PYTHONPATH,
so that the pin is set before any thread exists and XLA's threads inherit it; every process runs
XLA:CPU with --xla_cpu_multi_thread_eigen=false. The remote controller process is NOT pinned: it
shares both cores with the workers (it is idle while they compute, except for dispatch, gRPC
and metrics fetches); the distributed launcher process is not pinned either (it only relays
logs). Each run checks that its two island processes were pinned to two different cores.

Measured: per run (a "block"), train.num_steps = --warmup + --steps steps with
train.log_every=--log_every, so the trainer syncs on the metrics every log_every steps as a real
run does (backend.max_inflight_steps=1); each metrics.jsonl row's step_time_s is the mean step
time of its log_every steps; the rows of the first --warmup steps (compilation, first transfers)
are dropped and the block's step time is the median of the others. Remote and distributed blocks
alternate (remote first in even blocks, distributed first in odd ones), --blocks times per
(layout, size) (default 5 at small and medium, 3 at large); each mode's step time is the median
of its blocks. ratio = distributed / remote step time: remote throughput as a fraction of
distributed; parity is ratio >= 0.95 (the issue's target: from about 50 ms per node on).
Compiled programs are cached per (layout, size, mode) across blocks (train.compile_cache_dir),
so only the first block of each compiles.

Caveat: 2 cores shared with the OS; each process also has Python threads (the trainer's data
thread, gRPC or the coordination service), so the machine is slightly oversubscribed, and the
remote controller takes cycles from the workers' cores.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import common

REPO = str(common.REPO)
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=1"
PARITY = 0.95

# What every size shares; d_model, heads of d_model / 8 and d_ff = 4 d_model come per size.
MODEL = {
  "model.num_layers": 4,
  "model.num_heads": 8,
  "model.num_kv_heads": 1,
  "model.vocab_size": 512,
  "optim.name": "sgd",
  "optim.lr": 0.01,
  "optim.warmup_steps": 1,
  "train.eval_every": 0,
  "train.checkpoint_every": 1_000_000,  # the end of the run only (after the timed steps)
  "parallel.devices_per_island": 1,
}
# size: (d_model, {layout: (seq_len, rows per microbatch or pod)}); see the docstring's table.
SIZES = {
  "small": (128, {"pipeline": (64, 1), "pods": (32, 1)}),
  "medium": (256, {"pipeline": (128, 2), "pods": (128, 1)}),
  "large": (512, {"pipeline": (256, 3), "pods": (320, 1)}),
}
BLOCKS = {"small": 5, "medium": 5, "large": 3}
STEPS = {"small": 20, "medium": 20, "large": 10}
# The work nodes of a step: pipeline F/B/W (stage 0..S-2) and FB (last stage), pods FB.
WORK_NODE = re.compile(r"^\d+:(F|B|W|FB)\d+\.\d+$")

# Run by every child process before anything else (PYTHONPATH): pins island or process i to core
# i of those allowed (os.sched_setaffinity, as bench_distributed.py), while the process has one
# thread, so that every thread it starts later (XLA's included) inherits the pin. A remote worker
# is recognized by its --island=island<i> flag, a distributed process by $PWTRAIN_PROCESS_ID;
# each pin is appended to the file named by $BENCH_CONTROLLERS_PIN.
SITECUSTOMIZE = """
import os
import re

def _bench_controllers_pin():
  log = os.environ.get("BENCH_CONTROLLERS_PIN")
  if not log:
    return
  index, kind = os.environ.get("PWTRAIN_PROCESS_ID"), "process"
  if index is None:
    try:
      with open("/proc/self/cmdline", "rb") as f:
        args = f.read().split(b"\\0")
    except OSError:
      return
    found = [m for a in args if (m := re.match(rb"--island=island(\\d+)$", a))]
    if not found:
      return
    index, kind = found[0].group(1).decode(), "worker"
  cores = sorted(os.sched_getaffinity(0))
  core = cores[int(index) % len(cores)]
  os.sched_setaffinity(0, {core})
  with open(log, "a") as f:
    f.write(f"{kind} {index} {os.getpid()} {core}\\n")

_bench_controllers_pin()
"""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--sizes", default="small,medium,large")
  p.add_argument("--layouts", default="pipeline,pods")
  p.add_argument("--blocks", type=int, default=0, help="blocks per mode (0: 5, 5, 3 by size)")
  p.add_argument("--steps", type=int, default=0, help="timed steps per block (0: 20, 20, 10)")
  p.add_argument("--warmup", type=int, default=0, help="untimed first steps (0: --log_every)")
  p.add_argument("--log_every", type=int, default=5, help="train.log_every: steps per row")
  p.add_argument("--micro", type=int, default=4, help="pipeline microbatches")
  p.add_argument("--max_files", type=int, default=20, help="data.max_files")
  p.add_argument("--no_probe", action="store_true", help="skip the traced per-node run")
  p.add_argument("--timeout_s", type=float, default=1800.0, help="per run")
  p.add_argument("--keep", action="store_true", help="keep the temp dir (workdirs, logs)")
  p.add_argument("--out", default="")
  return p.parse_args(argv)


def overrides(layout: str, size: str, args) -> dict:
  d_model, per_layout = SIZES[size]
  seq_len, rows = per_layout[layout]
  out = {**MODEL, "model.d_model": d_model, "model.head_dim": d_model // 8}
  out.update({"model.d_ff": 4 * d_model, "data.seq_len": seq_len, "data.max_files": args.max_files})
  if layout == "pipeline":
    out.update({"parallel.islands": 2, "parallel.stages": 2, "parallel.schedule": "1f1b"})
    out.update({"train.num_microbatches": args.micro, "train.global_batch": args.micro * rows})
  else:
    out.update({"parallel.islands": 2, "parallel.pods": 2, "exchange.mode": "sync"})
    out.update({"data.streams": 2, "train.global_batch": 2 * rows})
  return out


def main_flags(config: dict, workdir: str) -> list[str]:
  """pwtrain.main's flags: --config=palm_tiny, --workdir and one --config.KEY=VALUE each."""
  return ["--config=palm_tiny", f"--workdir={workdir}"] + [
    f"--config.{k}={v}" for k, v in config.items()
  ]


class Runner:
  """Starts the runs in a temp dir of its own: workdirs, logs, compile caches, the pin hook."""

  def __init__(self, args):
    self.args = args
    self.root = tempfile.mkdtemp(prefix="bench_controllers_")
    self.hook = os.path.join(self.root, "hook")
    os.makedirs(self.hook)
    with open(os.path.join(self.hook, "sitecustomize.py"), "w") as f:
      f.write(SITECUSTOMIZE)
    self.count = 0

  def env(self, pins: str) -> dict:
    env = dict(os.environ)
    path = [self.hook, REPO, *filter(None, [env.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu", XLA_FLAGS=ONE_THREAD)
    # The workers' log dirs (launcher.py's mkdtemp) land in the temp dir too.
    env.update(BENCH_CONTROLLERS_PIN=pins, TMPDIR=self.root, PYTHONUNBUFFERED="1")
    return env

  def run(self, mode: str, layout: str, size: str, config: dict) -> tuple[list[dict], dict]:
    """metrics.jsonl's rows of one run of `mode` ("remote" or "distributed") and its pins
    {island index: core}; the workdir is kept until the Runner closes (traces)."""
    self.count += 1
    workdir = os.path.join(self.root, f"{self.count:03d}_{layout}_{size}_{mode}")
    pins = workdir + ".pins"
    cache = os.path.join(self.root, f"cache_{layout}_{size}_{mode}")
    flags = main_flags({**config, "train.compile_cache_dir": cache}, workdir)
    if mode == "remote":
      remote = ["--config.backend.mode=remote", "--config.backend.launch_workers=True"]
      command = [sys.executable, "-m", "pwtrain.main", *flags, *remote]
    else:
      launch = ["-m", "pwtrain.launch", "--nproc=2", "--devices_per_process=1", "--"]
      command = [sys.executable, *launch, *flags]
    try:
      done = subprocess.run(
        command,
        cwd=REPO,
        env=self.env(pins),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=self.args.timeout_s,
      )
    except subprocess.TimeoutExpired as e:
      raise RuntimeError(f"{mode} run timed out after {self.args.timeout_s:.0f} s") from e
    with open(workdir + ".log", "wb") as f:  # the run's console (--keep keeps it)
      f.write(done.stdout)
    if done.returncode:
      tail = done.stdout.decode(errors="replace")[-3000:]
      raise RuntimeError(f"{mode} run failed (exit {done.returncode}):\n{tail}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    return rows, read_pins(pins, mode)

  def close(self) -> None:
    if self.args.keep:
      print(f"kept {self.root}")
    else:
      shutil.rmtree(self.root, ignore_errors=True)


def read_pins(path: str, mode: str) -> dict:
  """{island index: core} of the run's island processes; raises unless 2 distinct cores."""
  pins = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        _, index, _, core = line.split()
        pins[int(index)] = int(core)
  if sorted(pins) != [0, 1] or len(set(pins.values())) != min(2, len(os.sched_getaffinity(0))):
    raise RuntimeError(f"{mode}: island processes not pinned to a core each: {pins}")
  return pins


def step_time(rows: list[dict], warmup: int) -> float:
  """Median step_time_s of the rows after the first `warmup` steps."""
  times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
  if not times:
    raise RuntimeError("no metrics rows after the warm-up: raise --steps")
  return statistics.median(times)


def node_times(workdir: str) -> dict:
  """Median wall ms of the work nodes in the traced run's steps after the first, over both
  processes' trace.json: all of them ("node") and by kind (F, B, FB, ...)."""
  paths = [os.path.join(workdir, "trace.json")]
  others = os.path.join(workdir, "processes")
  if os.path.isdir(others):
    paths += [os.path.join(others, p, "trace.json") for p in sorted(os.listdir(others))]
  spans: dict[str, list[float]] = {}
  for path in paths:
    with open(path) as f:
      events = json.load(f)["traceEvents"]
    for e in events:
      m = WORK_NODE.match(e.get("name", ""))
      if e.get("ph") == "X" and m and e["args"]["step"] >= 1:
        spans.setdefault(m.group(1), []).append(e["dur"] / 1e3)
  if not spans:
    raise RuntimeError(f"no work nodes traced in {paths}")
  out = {kind: statistics.median(v) for kind, v in sorted(spans.items())}
  out["node"] = statistics.median([x for v in spans.values() for x in v])
  return out


def probe(runner: Runner, layout: str, size: str, config: dict) -> dict:
  """Per-node wall times from one short traced distributed run (3 steps, steps 1-2 counted)."""
  config = {**config, "backend.trace": True, "train.num_steps": 3, "train.log_every": 1}
  runner.run("distributed", layout, size, config)
  workdir = os.path.join(runner.root, f"{runner.count:03d}_{layout}_{size}_distributed")
  return node_times(workdir)


def measure(runner: Runner, layout: str, size: str, args) -> dict:
  blocks = args.blocks or BLOCKS[size]
  log_every = args.log_every
  warmup = args.warmup or log_every
  steps = args.steps or STEPS[size]
  steps = -(-steps // log_every) * log_every  # whole rows
  warmup = -(-warmup // log_every) * log_every
  config = overrides(layout, size, args)
  result = {"config": config, "warmup": warmup, "steps": steps, "log_every": log_every}
  if not args.no_probe:
    try:
      result["node_ms"] = probe(runner, layout, size, config)
    except RuntimeError as e:
      result["probe_error"] = str(e)
      print(f"  {layout} {size}: traced probe failed: {str(e)[-500:]}", flush=True)
  timed = {**config, "train.num_steps": warmup + steps, "train.log_every": log_every}
  modes = ("remote", "distributed")
  result.update({m: [] for m in modes})
  for block in range(blocks):
    for mode in modes if block % 2 == 0 else modes[::-1]:
      if f"{mode}_error" in result:
        continue
      start = time.perf_counter()
      try:
        rows, pins = runner.run(mode, layout, size, timed)
        result[mode].append(step_time(rows, warmup))
        result.setdefault(f"{mode}_pins", pins)
      except RuntimeError as e:
        result[f"{mode}_error"] = str(e)
        print(f"  {layout} {size} {mode}: {str(e)[-2000:]}", flush=True)
        continue
      wall = time.perf_counter() - start
      print(
        f"  {layout} {size} block {block} {mode}: {result[mode][-1]:.4f} s/step ({wall:.0f} s)",
        flush=True,
      )
  for mode in modes:
    if result[mode]:
      result[f"{mode}_s"] = statistics.median(result[mode])
  if "remote_s" in result and "distributed_s" in result:
    result["ratio"] = result["distributed_s"] / result["remote_s"]
  return result


def line(layout: str, size: str, r: dict) -> str:
  def secs(mode):
    return f"{r[f'{mode}_s']:.4f} s" if f"{mode}_s" in r else "failed"

  node = f"{r['node_ms']['node']:.1f} ms" if "node_ms" in r else "n/a"
  ratio = f"{r['ratio']:.2f}" if "ratio" in r else "n/a"
  n = max(len(r["remote"]), len(r["distributed"]))
  return (
    f"{layout:8s} {size:6s}  node {node:>9s}  remote {secs('remote'):>9s}  "
    f"distributed {secs('distributed'):>9s}  dist/remote {ratio:>4s}  ({n} blocks)"
  )


def parity(results: dict, layout: str, sizes: list[str]) -> str:
  """Where parity starts: the smallest size from which every larger one has ratio >= 0.95."""
  ratios = [(s, results[f"{layout} {s}"].get("ratio")) for s in sizes]
  if any(r is None for _, r in ratios):
    return "incomplete"
  start = None
  for size, r in reversed(ratios):
    if r < PARITY:
      break
    start = size
  if start is None:
    return f"no parity (ratio < {PARITY}) at {sizes[-1]}"
  node = results[f"{layout} {start}"].get("node_ms", {}).get("node")
  where = f" (~{node:.0f} ms per node)" if node else ""
  return f"parity (>= {PARITY}) from {start}{where}"


def git_commit() -> str:
  try:
    head = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      cwd=REPO,
      capture_output=True,
      text=True,
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")
  except OSError:
    return ""


def main(argv=None) -> None:
  args = parse_args(argv)
  sizes = [s for s in args.sizes.split(",") if s]
  layouts = [x for x in args.layouts.split(",") if x]
  for name, known in (("size", SIZES), ("layout", ("pipeline", "pods"))):
    for x in sizes if name == "size" else layouts:
      if x not in known:
        sys.exit(f"unknown {name} {x!r}: choose from {', '.join(known)}")
  load = common.Load()
  runner = Runner(args)
  results = {}
  try:
    for size in sizes:
      for layout in layouts:
        results[f"{layout} {size}"] = r = measure(runner, layout, size, args)
        print(line(layout, size, r), flush=True)
  finally:
    runner.close()
  print("\nmedian seconds per step; dist/remote = remote throughput as a fraction of distributed")
  for key, r in results.items():
    print(line(*key.split(), r))
  for layout in layouts:
    print(f"{layout}: {parity(results, layout, sizes)}")
  meta = {"cpu_count": os.cpu_count(), "commit": git_commit(), **load.report()}
  print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
  if args.out:
    common.write_json(args.out, {"meta": meta, "results": results})


if __name__ == "__main__":
  main()
