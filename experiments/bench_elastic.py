"""Goodput under faults (elastic pods against restart-from-checkpoint), and time to first step
with a cold and a warm compilation cache.

  python experiments/bench_elastic.py                       # both sections
  python experiments/bench_elastic.py --sections=faults --steps=200 --fault_every=50 \
    --fault_offset=25 --rejoin_after=10
  python experiments/bench_elastic.py --sections=faults --mode=remote

faults   3 pods of palm_tiny (2 devices each, sync exchange, --microbatches microbatches each,
         --global_batch rows a step) train --steps steps in --mode
         (embedded, or remote: one worker process per pod, launched by the run), and pod 1 is
         lost every --fault_every steps (--fault_offset into each interval), four sides run
         one after another, after a short warm-up run that fills the cache:
           clean    no fault (the reference step time)
           elastic  fault.elastic=True and the drill `kill:pod1@stepN`; embedded: the pod's
                    islands fail, and `rejoin:pod1@stepN+R` (R = --rejoin_after) brings them
                    back; remote: pod 1's worker process is SIGKILLed, the supervisor relaunches
                    it and the pod rejoins once it answers. The run drops the pod and carries on,
                    pod 0 hosting pod 1's work (fault.host_lost_pods)
           rebuilt  the same with fault.host_lost_pods=False: the survivors' own program
           restart  without fault.elastic: resuming from the last checkpoint
                    (train.checkpoint_every) with a warm compilation cache: embedded, the
                    process is SIGKILLed once step N is logged and started again; remote, pod
                    1's worker is SIGKILLed and the supervisor restarts every worker and resumes
                    (fault.max_restarts)
         --fault_blocks blocks of the four sides, medians over the blocks. Goodput = (kept
         steps x the clean run's median step time) / wall time, where wall time runs from the
         first process start to the last exit; seconds lost per fault = (span - the block's
         clean span) / faults, where a span runs from the first step's metrics row to the last
         one's (process starts vary by a second or more from run to run: outside the span;
         a restart's are inside it). The elastic sides' breakdown (detection, compile, state
         move) is read from their drop lines: detection is from the drill's kill to the drop
         (embedded: the kill is at a step boundary; the steps in flight are confirmed first);
         the steps run again are counted from the log.
first    time to first step (process start to the first metrics row) of palm_tiny and of
         palm_tiny_pipeline: with an empty compilation cache; with the cache the first run left
         in a fresh workdir; and a restart in that workdir, all reading one corpus built first
         (see first_step), side by side per block (--blocks), medians.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO, machine, write_json

TINY = {
  "model.num_layers": 2,
  "model.d_model": 64,
  "model.num_heads": 8,
  "model.head_dim": 8,
  "model.d_ff": 128,
  "data.seq_len": 32,
  "data.max_files": 40,
}
THREE_PODS = {
  **TINY,
  "parallel.islands": 3,
  "parallel.devices_per_island": 2,
  "parallel.pods": 3,
  "parallel.data": -1,
  "exchange.mode": "sync",
  "train.global_batch": 12,
  "train.eval_every": 0,
  "train.log_every": 1,
}


def start(workdir: str, config: str, overrides: dict, cache: str) -> subprocess.Popen:
  """pwtrain.main on `config`, its output into `workdir`.log (read with `output`)."""
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  command = [
    sys.executable, "-m", "pwtrain.main", f"--config={REPO / 'configs' / config}",
    f"--workdir={workdir}", f"--config.train.compile_cache_dir={cache}", *flags,
  ]  # fmt: skip
  with open(f"{workdir}.log", "a") as log:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def output(workdir: str) -> str:
  with open(f"{workdir}.log") as f:
    return f.read()


def logged_steps(workdir: str, name: str = "metrics.jsonl") -> list[int]:
  path = os.path.join(workdir, name)
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if '"loss"' in line]


class Watch:
  """When each step's metrics row first appeared in a workdir's metrics.jsonl (log_every=1),
  across every process started there."""

  def __init__(self, workdir: str):
    self.workdir, self.seen = workdir, {}

  def poll(self) -> list[int]:
    steps = logged_steps(self.workdir)
    for step in steps:
      self.seen.setdefault(step, time.perf_counter())
    return steps

  def wait(self, proc: subprocess.Popen, until=None) -> None:
    """Polls until `proc` exits, or until `until(steps)` holds."""
    while proc.poll() is None:
      steps = self.poll()
      if until is not None and until(steps):
        return
      time.sleep(0.005)
    self.poll()

  def span_s(self) -> float:
    """From the first step's row to the last step's: the training, without the starts."""
    return self.seen[max(self.seen)] - self.seen[min(self.seen)]

  def step_s(self) -> float:
    times = [self.seen[s] for s in sorted(self.seen)]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def pods(args) -> dict:
  """The three pods' settings in --mode, with --microbatches and --global_batch."""
  batch = {"train.num_microbatches": args.microbatches, "train.global_batch": args.global_batch}
  if args.mode == "remote":
    return {**THREE_PODS, **batch, "backend.mode": "remote", "backend.launch_workers": True}
  return {**THREE_PODS, **batch}


def run_clean(root: str, args, cache: str) -> dict:
  workdir = os.path.join(root, "clean")
  begin, watch = time.perf_counter(), Watch(workdir)
  proc = start(workdir, "palm_tiny.py", {**pods(args), "train.num_steps": args.steps}, cache)
  watch.wait(proc)
  assert proc.returncode == 0, output(workdir)[-3000:]
  wall = time.perf_counter() - begin
  return {"wall_s": wall, "span_s": watch.span_s(), "step_s": watch.step_s(), "faults": 0}


def fault_steps(args) -> list[int]:
  """Where pod 1 is lost: every --fault_every steps, --fault_offset into each interval (a fault
  falls between checkpoints, not on one)."""
  return list(range(args.fault_offset, args.steps, args.fault_every))


def run_elastic(root: str, args, cache: str, name: str = "elastic", host: bool = True) -> dict:
  workdir = os.path.join(root, name)
  steps, rejoin = args.steps, args.rejoin_after
  drills = []
  for n in fault_steps(args):
    drills.append(f"kill:pod1@step{n}")
    if args.mode == "embedded":  # remote: the relaunched worker rejoins once it answers
      drills.append(f"rejoin:pod1@step{min(n + rejoin, steps)}")
  overrides = {
    **pods(args), "train.num_steps": steps, "fault.elastic": True,
    "fault.inject": ",".join(drills), "fault.host_lost_pods": host,
  }  # fmt: skip
  begin, watch = time.perf_counter(), Watch(workdir)
  proc = start(workdir, "palm_tiny.py", overrides, cache)
  watch.wait(proc)
  out = output(workdir)
  assert proc.returncode == 0, out[-3000:]
  wall = time.perf_counter() - begin
  pattern = (
    r"lost .*?(?:found ([\d.]+) s after the fault; )?took ([\d.]+) s \(compile ([\d.]+) s, "
    r"state ([\d.]+) s\); steps (\d+)-(\d+)"
  )
  drops = [
    {"detect_s": float(m[0] or 0), "seconds": float(m[1]), "compile_s": float(m[2]),
     "state_s": float(m[3]), "rerun": int(m[5]) - int(m[4]) + 1}
    for m in re.findall(pattern, out)
  ]  # fmt: skip
  rejoins = [float(s) for s in re.findall(r"rejoined .* took ([\d.]+) s", out)]
  return {
    "wall_s": wall, "span_s": watch.span_s(), "faults": len(drops), "drops": drops,
    "rejoins_s": rejoins,
  }  # fmt: skip


def worker_pid(proc: subprocess.Popen, island: str) -> int | None:
  """The pid of the run's worker process of `island` (remote mode), if it runs."""
  ps = subprocess.run(
    ["ps", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True
  )
  for line in ps.stdout.splitlines():
    pid, command = line.strip().split(None, 1)
    if "pwtrain.backend.remote.worker" in command and f"--island={island}" in command:
      return int(pid)
  return None


def run_restart_remote(root: str, args, cache: str) -> dict:
  """Remote mode's restart path: pod 1's worker is SIGKILLed once step N is logged; the
  supervisor restarts every worker and resumes from the last checkpoint, in the same process."""
  workdir = os.path.join(root, "restart")
  kills = fault_steps(args)
  overrides = {
    **pods(args), "train.num_steps": args.steps, "train.checkpoint_every": args.fault_every,
    "fault.max_restarts": len(kills),
  }  # fmt: skip
  begin, watch = time.perf_counter(), Watch(workdir)
  proc = start(workdir, "palm_tiny.py", overrides, cache)
  done = 0
  while done < len(kills):
    watch.wait(proc, until=lambda steps, n=kills[done]: n in steps)
    if proc.poll() is not None:
      break
    pid = worker_pid(proc, "island1")
    if pid is not None:
      os.kill(pid, signal.SIGKILL)
      done += 1
  watch.wait(proc)
  assert proc.returncode == 0, output(workdir)[-3000:]
  # The rows of steps trained again were set aside at each resume.
  redone = len(logged_steps(workdir, "metrics.rolled_back.jsonl"))
  return {
    "wall_s": time.perf_counter() - begin, "span_s": watch.span_s(), "faults": done,
    "steps_redone": redone,
  }  # fmt: skip


def run_restart(root: str, args, cache: str) -> dict:
  if args.mode == "remote":
    return run_restart_remote(root, args, cache)
  workdir = os.path.join(root, "restart")
  overrides = {
    **pods(args),
    "train.num_steps": args.steps,
    "train.checkpoint_every": args.fault_every,
  }
  kills = fault_steps(args)
  begin, watch = time.perf_counter(), Watch(workdir)
  starts, redone, last_kill = 0, 0, 0
  while True:
    starts += 1
    seen = os.path.getsize(f"{workdir}.log") if os.path.exists(f"{workdir}.log") else 0
    proc = start(workdir, "palm_tiny.py", overrides, cache)
    target = kills[0] if kills else None
    watch.wait(proc, until=lambda steps, n=target: n is not None and n in steps)
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)  # a lost pod stops every pod: the whole run dies
      proc.wait()
    out = output(workdir)[seen:]
    resumed = re.search(r"resumed from step (\d+)", out)
    if starts > 1:  # this start redid the steps between its checkpoint and the last kill
      redone += last_kill - (int(resumed[1]) if resumed else 0)
    if target is not None and proc.returncode == -signal.SIGKILL:
      kills.pop(0)
      last_kill = target
      continue
    assert proc.returncode == 0, out[-3000:]
    break
  return {
    "wall_s": time.perf_counter() - begin, "span_s": watch.span_s(), "faults": starts - 1,
    "steps_redone": redone,
  }  # fmt: skip


SIDES = ("clean", "elastic", "rebuilt", "restart")


def faults(args, cache: str) -> dict:
  """--fault_blocks blocks of the four sides, one after another; per side the medians over the
  blocks. Seconds lost per fault = (the side's span - the same block's clean span) / faults,
  where a span runs from the first step's metrics row to the last one's (the process starts,
  a second or more of noise from run to run, fall outside it; a restart's fall inside)."""
  # Every side starts warm: a short elastic run compiles the programs of both pod sets first.
  root = tempfile.mkdtemp(prefix="bench_elastic_")
  warmup = argparse.Namespace(**{**vars(args), "steps": 4, "fault_offset": 2, "rejoin_after": 1})
  run_elastic(root, warmup, cache, name="warmup", host=False)
  blocks = []
  for b in range(args.fault_blocks):
    root = tempfile.mkdtemp(prefix=f"bench_elastic_{b}_")
    block = {"clean": run_clean(root, args, cache)}
    block["elastic"] = run_elastic(root, args, cache)
    block["rebuilt"] = run_elastic(root, args, cache, name="rebuilt", host=False)
    block["restart"] = run_restart(root, args, cache)
    clean = block["clean"]
    for name in SIDES[1:]:
      side = block[name]
      side["goodput"] = args.steps * clean["step_s"] / side["wall_s"]
      side["lost_per_fault_s"] = (side["span_s"] - clean["span_s"]) / max(side["faults"], 1)
    print(
      f"block {b + 1}: clean step {clean['step_s'] * 1e3:.1f} ms, "
      + ", ".join(f"{n} {block[n]['lost_per_fault_s']:.2f} s/fault" for n in SIDES[1:]),
      flush=True,
    )
    blocks.append(block)
  med = lambda name, key: statistics.median(block[name][key] for block in blocks)
  clean_step = med("clean", "step_s")
  print(
    f"clean: step {clean_step * 1e3:.1f} ms (median), wall {med('clean', 'wall_s'):.1f} s, "
    f"span {med('clean', 'span_s'):.1f} s; medians of {len(blocks)} blocks:"
  )
  for name in SIDES[1:]:
    print(
      f"{name:8s} wall {med(name, 'wall_s'):.1f} s, span {med(name, 'span_s'):.1f} s, goodput "
      f"{med(name, 'goodput'):.3f}, {med(name, 'lost_per_fault_s'):.2f} s lost per fault "
      f"({blocks[0][name]['faults']} faults), = {med(name, 'lost_per_fault_s') / clean_step:.1f} "
      "clean steps"
    )
  for name in ("elastic", "rebuilt"):
    drops = [d for block in blocks for d in block[name]["drops"]]
    for key in ("detect_s", "compile_s", "state_s"):
      values = [d[key] for d in drops]
      print(f"  {name} drops, {key}: {', '.join(f'{v:.2f}' for v in values)}")
    print(f"  {name} steps run again per drop: {sorted({d['rerun'] for d in drops})}")
    rejoins = [s for block in blocks for s in block[name]["rejoins_s"]]
    print(f"  {name} rejoins, s: {', '.join(f'{s:.2f}' for s in rejoins)}")
  redone = [block["restart"]["steps_redone"] for block in blocks]
  print(f"  restart: steps redone in all, per block: {redone}")
  result = {"blocks": blocks}
  for name in ("elastic", "rebuilt"):
    # From the drop lines: detection, the drop's own seconds (compile, state) and the steps
    # run again at the clean step time. What the span adds beyond that (steps of the live pods
    # slower or faster than the clean run's) is in the span figure, within its noise.
    drops = [d for block in blocks for d in block[name]["drops"]]
    parts = statistics.mean(d["detect_s"] + d["seconds"] + d["rerun"] * clean_step for d in drops)
    lost = med(name, "lost_per_fault_s")
    print(
      f"{name}: {parts:.2f} s per fault from its drop lines ({parts / clean_step:.1f} clean "
      f"steps); restart loses {med('restart', 'lost_per_fault_s') / parts:.1f}x that, and "
      + (f"{med('restart', 'lost_per_fault_s') / lost:.1f}x its span figure" if lost > 0 else
         "its span figure is below zero (the degraded steps were no slower)")
    )  # fmt: skip
    result[f"{name}_per_fault_from_drops_s"] = parts
  return result


def first_step(args) -> dict:
  """Per block, three starts that share one compilation cache and one corpus, built before
  any is timed (data.data_dir), so that they differ in what the cache holds: cold (empty
  cache, fresh workdir), warm (the cache the first left, a fresh workdir) and a restart (the
  warm run's workdir again, one step further: checkpoint restored, every program in the
  cache). Time to first step: process start to the new metrics row."""
  out = {}
  configs = {
    "palm_tiny": ("palm_tiny.py", {"data.max_files": 40}),
    "palm_tiny_pipeline": ("palm_tiny_pipeline.py", {"data.max_files": 40}),
  }
  for name, (file, overrides) in configs.items():
    times = {"cold": [], "warm": [], "restart": []}
    for _ in range(args.blocks):
      root = tempfile.mkdtemp(prefix="bench_first_")
      cache, data = os.path.join(root, "cache"), os.path.join(root, "tfds")
      subprocess.run(
        [sys.executable, "-c", f"from pwtrain.data.corpus import prepare_pystdlib; "
         f"prepare_pystdlib({data!r}, {overrides['data.max_files']})"],
        cwd=REPO, check=True,
      )  # fmt: skip
      workdirs = {"cold": tempfile.mkdtemp(dir=root), "warm": tempfile.mkdtemp(dir=root)}
      workdirs["restart"] = workdirs["warm"]
      for side, steps in (("cold", 1), ("warm", 1), ("restart", 2)):
        workdir = workdirs[side]
        seen = len(logged_steps(workdir))
        run = {**overrides, "train.num_steps": steps, "train.eval_every": 0,
               "train.checkpoint_every": 1, "train.log_every": 1,
               "data.data_dir": data}  # fmt: skip
        begin = time.perf_counter()
        proc = start(workdir, file, run, cache)
        Watch(workdir).wait(proc, until=lambda steps, seen=seen: len(steps) > seen)
        times[side].append(time.perf_counter() - begin)
        proc.wait()
        assert proc.returncode == 0, output(workdir)[-3000:]
    medians = {side: statistics.median(t) for side, t in times.items()}
    out[name] = {"seconds": times, "medians_s": medians}
    c, w, r = medians["cold"], medians["warm"], medians["restart"]
    print(
      f"{name}: time to first step cold {c:.2f} s, warm (fresh workdir) {w:.2f} s ({c / w:.2f}x), "
      f"restart (same workdir) {r:.2f} s ({c / r:.2f}x)"
    )
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sections", default="faults,first")
  parser.add_argument("--mode", default="embedded", choices=("embedded", "remote"))
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--fault_every", type=int, default=50)
  parser.add_argument("--fault_offset", type=int, default=25, help="steps into each interval")
  parser.add_argument("--rejoin_after", type=int, default=10)
  parser.add_argument("--microbatches", type=int, default=1, help="faults: per pod")
  parser.add_argument("--global_batch", type=int, default=12, help="faults: rows per step")
  parser.add_argument("--fault_blocks", type=int, default=3, help="faults: blocks of 4 sides")
  parser.add_argument("--blocks", type=int, default=3, help="first: blocks of 3 starts")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its runs simulate CPU devices (no libtpu)
  result = {"machine": machine(), "args": vars(args)}
  sections = args.sections.split(",")
  if "faults" in sections:
    result["faults"] = faults(args, os.path.join(tempfile.mkdtemp(), "cache"))
  if "first" in sections:
    result["first"] = first_step(args)
  if args.out:
    write_json(args.out, result)


if __name__ == "__main__":
  main()
