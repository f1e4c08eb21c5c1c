"""Goodput under faults (elastic pods against restart-from-checkpoint), and time to first step
with a cold and a warm compilation cache.

  python experiments/bench_elastic.py                       # both sections
  python experiments/bench_elastic.py --sections=faults --steps=200 --fault_every=50 \
    --fault_offset=25 --checkpoint_every=50 --rejoin_after=10
  python experiments/bench_elastic.py --sections=faults --mode=remote
  python experiments/bench_elastic.py --sections=faults --mode=distributed --steps=120 \
    --fault_every=60 --fault_offset=30 --checkpoint_every=60
  python experiments/bench_elastic.py --sections=faults --mode=remote --sides=clean,elastic,stopped
  python experiments/bench_elastic.py --sections=faults --mode=remote \
    --sides=clean,elastic,stopped,wedged --steps=120 --fault_every=30 --fault_offset=15

faults   3 pods (2 devices each, sync exchange, --microbatches microbatches each, --global_batch
         rows a step) train --steps steps in --mode: embedded; remote (a worker process per
         pod, launched by the run); distributed (a process per pod, started by pwtrain.launch:
         the pods compute at once, each on its own process). Every side checkpoints every
         --checkpoint_every steps. Pod 1 is lost every --fault_every steps (--fault_offset into
         each interval). Four sides run one after another in each block, after a short warm-up
         run that fills the compilation cache:
           clean    no fault (the reference step time)
           elastic  fault.elastic, the lost pod hosted by the others. Embedded (no process to
                    kill): the drill kill:pod1@midN (its islands fail while step N runs, their
                    arrays deleted) and rejoin:pod1@stepN+R (R = --rejoin_after). Remote and
                    distributed: this script SIGKILLs pod 1's worker or process once step N's
                    metrics row is written (and only while pod 1 is live); the supervisor or the
                    launcher starts it again and it rejoins once it is ready
           rebuilt  the same with fault.host_lost_pods=False: the survivors' own program
           restart  no fault.elastic, the same SIGKILLs (embedded: of the process, which this
                    script starts again; remote: of the worker, the supervisor restarting every
                    worker; distributed: of process 1, the launcher restarting every process),
                    each start resuming from the last checkpoint
           stopped  a silent fault: as elastic, but this script SIGSTOPs pod 1's worker
                    (remote) or process (distributed) instead: alive, its sockets open, never
                    answering. The run must find it lost (remote: 3 missed pings, fault.
                    heartbeat_s each; distributed: the launcher's heartbeat files), kill it and
                    start it again; detection runs from the SIGSTOP to the drop's start, and its
                    seconds lost per fault hold the detection. Embedded mode has no process to
                    stop (every pod runs in the controller's process): no such side there
           wedged   a silent fault of the execution: as elastic, but pod 1's islands are sent a
                    computation that never ends (the drill wedge:pod1@stepN+1, N each fault
                    step), their processes alive and answering. The run must find it wedged
                    (remote: its worker's op ran past fault.progress_timeout_s, --progress_
                    timeout_s, checked every fault.heartbeat_s, and the worker is killed and
                    relaunched; distributed: the process ends itself past it, the launcher
                    starts it again). A drill fires only while pod 1 is live (elastic/steps.py
                    skips one of a lost pod): a drill due before pod 1 rejoined is skipped, and
                    faults counts the drills fired (their log lines), not those scheduled.
                    Detection runs from the drill's line to the drop's start. No such side in
                    embedded mode (drills.check refuses the drill)
         --sides picks the sides (clean always runs: every other side is measured against it).
         --fault_blocks blocks, medians over the blocks. One method for every side: seconds lost
         per fault = (span - the same block's clean span) / faults, a span running from the
         first step's metrics row to the last one's (process starts vary by a second or more
         from run to run: outside the span; a restart's are inside it). Goodput = (steps x the
         clean run's median step time) / wall time, process start to exit, on every side; and
         each run's own goodput and badput by cause (its last interval row; a restart's, of its
         last start). Detection, remote and distributed: from the signal (wedged: the drill's
         log line) to the drop's start (its line's log time less the seconds it took);
         embedded: the drill's own figure
         ("found X s after the fault"). In distributed mode a process started again must reach
         the coordinator before the run ends (with fault_offset near --steps it may not).
first    time to first step (process start to the first metrics row) of palm_tiny and of
         palm_tiny_pipeline: with an empty compilation cache; with the cache the first run left
         in a fresh workdir; and a restart in that workdir, all reading one corpus built first
         (see first_step), side by side per block (--blocks), medians.
"""

import argparse
import datetime
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


def start(workdir: str, config: str, overrides: dict, cache: str, launch=None):
  """pwtrain.main on `config`, its output into `workdir`.log (read with `output`); with
  `launch` (pwtrain.launch's flags), its processes under the launcher."""
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  main = [
    f"--config={REPO / 'configs' / config}", f"--workdir={workdir}",
    f"--config.train.compile_cache_dir={cache}", *flags,
  ]  # fmt: skip
  if launch is None:
    command = [sys.executable, "-m", "pwtrain.main", *main]
  else:
    command = [sys.executable, "-m", "pwtrain.launch", *launch, "--", *main]
  with open(f"{workdir}.log", "a") as log:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def output(workdir: str) -> str:
  with open(f"{workdir}.log") as f:
    return f.read()


def rows(workdir: str, name: str = "metrics.jsonl") -> list[dict]:
  path = os.path.join(workdir, name)
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]  # not a row half written


def logged_steps(workdir: str, name: str = "metrics.jsonl") -> list[int]:
  return [row["step"] for row in rows(workdir, name) if "loss" in row]


class Watch:
  """When each step's metrics row first appeared in a workdir's metrics.jsonl (log_every=1),
  across every process started there."""

  def __init__(self, workdir: str):
    self.workdir, self.seen, self.steps, self.pods_live, self._stat = workdir, {}, [], None, None

  def poll(self) -> list[int]:
    """The steps logged; the file is read again only when it changed (the poll shares the
    CPU with the run it times)."""
    try:
      info = os.stat(os.path.join(self.workdir, "metrics.jsonl"))
      stat = (info.st_size, info.st_mtime_ns, info.st_ino)
    except OSError:
      stat = None
    if stat != self._stat:
      written = rows(self.workdir)
      self._stat, self.steps = stat, [row["step"] for row in written if "loss" in row]
      live = [row["pods_live"] for row in written if "pods_live" in row]
      self.pods_live = live[-1] if live else None  # not every row has it (an interval's)
    for step in self.steps:
      self.seen.setdefault(step, time.perf_counter())
    return self.steps

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
  """The three pods' settings in --mode, with --microbatches, --global_batch and
  --checkpoint_every (every side's)."""
  batch = {
    "train.num_microbatches": args.microbatches, "train.global_batch": args.global_batch,
    "train.checkpoint_every": args.checkpoint_every, "train.num_steps": args.steps,
  }  # fmt: skip
  if args.mode == "remote":
    return {**THREE_PODS, **batch, "backend.mode": "remote", "backend.launch_workers": True}
  return {**THREE_PODS, **batch}


def launch_flags(args, restarts: int = 0) -> list[str] | None:
  """Distributed mode: pwtrain.launch's flags (3 processes of 2 devices)."""
  if args.mode != "distributed":
    return None
  return ["--nproc=3", "--devices_per_process=2", f"--max_restarts={restarts}"]


def fault_steps(args) -> list[int]:
  """Where pod 1 is lost: every --fault_every steps, --fault_offset into each interval (a fault
  falls between checkpoints, not on one)."""
  return list(range(args.fault_offset, args.steps, args.fault_every))


def own_goodput(workdir: str) -> dict:
  """The run's own goodput and badput by cause: its last interval row's."""
  last = [row for row in rows(workdir) if "goodput" in row]
  return {k: v for k, v in last[-1].items() if k == "goodput" or k.startswith("badput_")}


def pod1(args, proc: subprocess.Popen) -> int | None:
  """The pid of pod 1's worker (remote) or process (distributed), if it runs."""
  children = subprocess.run(
    ["ps", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True
  ).stdout.splitlines()
  for line in children:
    pid, command = line.strip().split(None, 1)
    if args.mode == "remote":
      if "pwtrain.backend.remote.worker" in command and "--island=island1" in command:
        return int(pid)
      continue
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if b"PWTRAIN_PROCESS_ID=1" in f.read().split(b"\0"):
          return int(pid)
    except OSError:
      continue
  return None


def kill_pod1(
  args, proc, watch: Watch, steps: list[int], elastic: bool, sig: int = signal.SIGKILL
) -> list[float]:
  """Sends `sig` (SIGKILL; SIGSTOP: a silent fault) to pod 1's worker or process once each
  step of `steps` has its row (elastic: only while pod 1 is live, as the rows' pods_live say),
  until `proc` exits; the signals' times."""
  kills = []
  for n in steps:

    def due(seen, n=n):
      if n not in seen:
        return False
      return not elastic or watch.pods_live == 3

    watch.wait(proc, until=due)
    pid = pod1(args, proc) if proc.poll() is None else None
    if pid is None:
      break
    os.kill(pid, sig)
    kills.append(time.time())
  return kills


def log_time(line: str) -> float | None:
  """A log line's time (absl's "W1127 03:31:26.4277"), as time.time() counts, or None."""
  m = re.search(r"[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d+)", line)
  if m is None:
    return None
  year = datetime.datetime.now().year
  return datetime.datetime.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S.%f").timestamp()


def wedges(out: str) -> list[float]:
  """The times of the wedge drills fired: their log lines' ("fault.inject wedge:pod1@stepN:
  island island1 runs a computation that never ends"; once per island, so once per drill here)."""
  lines = [line for line in out.splitlines() if "runs a computation that never ends" in line]
  return [t for t in map(log_time, lines) if t is not None]


def detections(out: str, kills: list[float]) -> list[float]:
  """Seconds from each kill (or wedge drill) to the start of the next drop: its line's log time
  (the line is written once the drop is done) less the drop's own seconds (its "took")."""
  times = []
  for line in out.splitlines():
    if " lost (" not in line or not re.search(r"pod [\d,]+ lost", line):
      continue
    stamp, took = log_time(line), re.search(r"took ([\d.]+) s", line)
    if stamp is not None and took:
      times.append(stamp - float(took[1]))
  found = []
  for kill in kills:
    after = [t for t in times if t >= kill]
    if after:
      found.append(min(after) - kill)
  return found


DROP = (
  r"lost .*?(?:found ([\d.]+) s after the fault; )?took ([\d.]+) s \(compile ([\d.]+) s, "
  r"state ([\d.]+) s\); (?:steps (\d+)-(\d+) run again)?"
)
STALL = r"lost .*?stalled ([\d.]+) s from the last step to the drop"


def run_side(root: str, args, cache: str, name: str) -> dict:
  """One side of a block (see the module doc)."""
  workdir = os.path.join(root, name)
  overrides, kills = pods(args), fault_steps(args)
  if name in ("elastic", "rebuilt", "stopped", "wedged"):
    overrides.update({"fault.elastic": True, "fault.host_lost_pods": name != "rebuilt"})
    if args.mode == "embedded":
      drills = [f"kill:pod1@mid{n},rejoin:pod1@step{min(n + args.rejoin_after, args.steps)}"
                for n in kills]  # fmt: skip
      overrides["fault.inject"] = ",".join(drills)
  if name == "wedged":  # before the step after each fault step: where a signal's fault lands
    drills = [f"wedge:pod1@step{n + 1}" for n in kills if n + 1 <= args.steps]
    overrides.update({"fault.inject": ",".join(drills),
                      "fault.progress_timeout_s": args.progress_timeout_s})  # fmt: skip
  if name == "restart":
    return run_restart(workdir, args, cache, overrides)
  begin, watch = time.perf_counter(), Watch(workdir)
  proc = start(workdir, "palm_tiny.py", overrides, cache, launch_flags(args))
  sent = []
  if name not in ("clean", "wedged") and args.mode != "embedded":
    sig = signal.SIGSTOP if name == "stopped" else signal.SIGKILL
    sent = kill_pod1(args, proc, watch, kills, elastic=True, sig=sig)
  watch.wait(proc)
  out = output(workdir)
  assert proc.returncode == 0, out[-3000:]
  if name == "wedged":  # the drills' lines (distributed: pod 1's process logs them)
    sent = wedges(out)
  if args.mode == "distributed":  # every survivor logs each drop and rejoin: process 0's lines
    out = "\n".join(line for line in out.splitlines() if line.startswith("[p0] "))
  side = {"wall_s": time.perf_counter() - begin, "span_s": watch.span_s(),
          "step_s": watch.step_s(), "own": own_goodput(workdir)}  # fmt: skip
  if name == "clean":
    return {**side, "faults": 0}
  drops = [
    {"detect_s": float(m[0]) if m[0] else None, "seconds": float(m[1]),
     "compile_s": float(m[2]), "state_s": float(m[3]),
     "rerun": int(m[5]) - int(m[4]) + 1 if m[4] else 0}
    for m in re.findall(DROP, out)
  ]  # fmt: skip
  detect = detections(out, sent) if sent else [d["detect_s"] for d in drops if d["detect_s"]]
  rejoins = [
    float(s) for s in re.findall(r"rejoined \(its islands run again\).* took ([\d.]+) s", out)
  ]
  faults = len(sent) if args.mode != "embedded" else len(drops)
  stalls = [float(s) for s in re.findall(STALL, out)]
  if name == "wedged":
    side["scheduled"] = len(overrides["fault.inject"].split(","))
  return {**side, "faults": faults, "drops": drops, "detect_s": detect, "rejoins_s": rejoins,
          "stalls_s": stalls}  # fmt: skip


def run_restart(workdir: str, args, cache: str, overrides: dict) -> dict:
  """The restart side: every fault a SIGKILL (see the module doc), every start resuming from
  the last checkpoint; restarts in the same process (remote's supervisor, the launcher) or, in
  embedded mode, by this script."""
  kills = fault_steps(args)
  begin, watch = time.perf_counter(), Watch(workdir)
  if args.mode != "embedded":
    if args.mode == "remote":
      overrides = {**overrides, "fault.max_restarts": len(kills)}
    proc = start(workdir, "palm_tiny.py", overrides, cache, launch_flags(args, len(kills)))
    sent = kill_pod1(args, proc, watch, kills, elastic=False)
    watch.wait(proc)
    assert proc.returncode == 0, output(workdir)[-3000:]
  else:
    sent = []
    while True:
      seen = os.path.getsize(f"{workdir}.log") if os.path.exists(f"{workdir}.log") else 0
      proc = start(workdir, "palm_tiny.py", overrides, cache)
      target = kills[len(sent)] if len(sent) < len(kills) else None
      watch.wait(proc, until=lambda steps, n=target: n is not None and n in steps)
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)  # a lost pod stops every pod: the whole run dies
        proc.wait()
      if target is not None and proc.returncode == -signal.SIGKILL:
        sent.append(time.time())
        continue
      assert proc.returncode == 0, output(workdir)[seen:][-3000:]
      break
  # The rows of steps trained again were set aside at each resume.
  redone = len(logged_steps(workdir, "metrics.rolled_back.jsonl"))
  return {
    "wall_s": time.perf_counter() - begin, "span_s": watch.span_s(), "faults": len(sent),
    "steps_redone": redone, "own": own_goodput(workdir),
  }  # fmt: skip


SIDES = ("clean", "elastic", "rebuilt", "restart", "stopped", "wedged")


def sides(args) -> tuple[str, ...]:
  """--sides in SIDES' order, clean first; no stopped or wedged side in embedded mode."""
  asked = set(args.sides.split(",")) | {"clean"}
  unknown = asked - set(SIDES)
  if unknown:
    raise SystemExit(f"--sides={args.sides}: unknown {sorted(unknown)}; choose from {SIDES}")
  if args.mode == "embedded" and "stopped" in asked:
    print("embedded mode: no stopped side (no process to SIGSTOP: every pod runs in one)")
    asked.discard("stopped")
  if args.mode == "embedded" and "wedged" in asked:
    print("embedded mode: no wedged side (nothing can unwedge the one process every pod runs in)")
    asked.discard("wedged")
  return tuple(name for name in SIDES if name in asked)


def faults(args, cache: str) -> dict:
  """--fault_blocks blocks of the sides, one after another; per side the medians over the
  blocks (see the module doc)."""
  # Every side starts warm: short runs compile the clean programs (the restart's too) and the
  # elastic ones of both pod sets first.
  root = tempfile.mkdtemp(prefix="bench_elastic_")
  warmup = argparse.Namespace(**{**vars(args), "steps": 4, "fault_offset": 2, "rejoin_after": 1})
  for name in ("clean", "rebuilt"):
    run_side(root, warmup, cache, name)
  blocks, names = [], sides(args)
  for b in range(args.fault_blocks):
    root = tempfile.mkdtemp(prefix=f"bench_elastic_{b}_")
    block = {name: run_side(root, args, cache, name) for name in names}
    clean = block["clean"]
    for name in names:
      side = block[name]
      side["goodput"] = args.steps * clean["step_s"] / side["wall_s"]
      if name != "clean":
        side["lost_per_fault_s"] = (side["span_s"] - clean["span_s"]) / max(side["faults"], 1)
    print(
      f"block {b + 1}: clean step {clean['step_s'] * 1e3:.1f} ms, "
      + ", ".join(f"{n} {block[n]['lost_per_fault_s']:.2f} s/fault ({block[n]['faults']})"
                  for n in names[1:]),
      flush=True,
    )  # fmt: skip
    blocks.append(block)
  return report(args, blocks, names)


def report(args, blocks: list[dict], names: tuple[str, ...]) -> dict:
  med = lambda name, key: statistics.median(block[name][key] for block in blocks)
  clean_step = med("clean", "step_s")
  print(f"{args.mode}: clean step {clean_step * 1e3:.1f} ms (median); medians of {len(blocks)} "
        "blocks; lost per fault = (span - clean span) / faults, every side:")  # fmt: skip
  for name in names:
    line = (
      f"{name:8s} wall {med(name, 'wall_s'):.1f} s, span {med(name, 'span_s'):.1f} s, goodput "
      f"{med(name, 'goodput'):.3f}"
    )
    if name != "clean":
      lost = med(name, "lost_per_fault_s")
      faults_n = [block[name]["faults"] for block in blocks]
      line += (
        f", {lost:.2f} s lost per fault ({lost / clean_step:.1f} clean steps; faults {faults_n})"
      )
    own = {k: statistics.median(block[name]["own"].get(k, 0.0) for block in blocks)
           for k in blocks[0][name]["own"]}  # fmt: skip
    line += "; its own: " + ", ".join(
      f"{k.removeprefix('badput_')} {v:.3f}" for k, v in own.items()
    )
    print(line)
  restart = med("restart", "lost_per_fault_s") if "restart" in names else None
  for name in [n for n in ("elastic", "rebuilt", "stopped", "wedged") if n in names]:
    lost = med(name, "lost_per_fault_s")
    if restart is not None:
      ratio = f"{restart / lost:.1f}x" if lost > 0 else "n/a (its figure is not above zero)"
      print(f"  restart / {name}: {ratio}")
    drops = [d for block in blocks for d in block[name]["drops"]]
    for key in ("compile_s", "state_s"):
      print(f"  {name} drops, {key}: {', '.join(f'{d[key]:.2f}' for d in drops)}")
    detect = [s for block in blocks for s in block[name]["detect_s"]]
    sig = {"stopped": "SIGSTOP", "wedged": "drill's line"}.get(name, "SIGKILL")
    source = f"from the {sig} to the drop" if args.mode != "embedded" else "the drills'"
    if name == "wedged":
      fired = [(block[name]["faults"], block[name]["scheduled"]) for block in blocks]
      print(f"  wedged drills fired / scheduled, per block: {fired} (a drill of a pod not "
            f"live is skipped); fault.progress_timeout_s={args.progress_timeout_s:g}")  # fmt: skip
    print(f"  {name} detection ({source}), s: {', '.join(f'{s:.2f}' for s in detect)}")
    stalls = [s for block in blocks for s in block[name]["stalls_s"]]
    print(f"  {name} stalls (the drop lines'), s: {', '.join(f'{s:.2f}' for s in stalls)}")
    print(f"  {name} steps run again per drop: {sorted({d['rerun'] for d in drops})}")
    rejoins = [s for block in blocks for s in block[name]["rejoins_s"]]
    print(f"  {name} rejoins, s: {', '.join(f'{s:.2f}' for s in rejoins)}")
  if restart is not None:
    redone = [block["restart"]["steps_redone"] for block in blocks]
    print(f"  restart: steps redone in all, per block: {redone}")
  return {"blocks": blocks}


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
  parser.add_argument("--mode", default="embedded", choices=("embedded", "remote", "distributed"))
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--fault_every", type=int, default=50)
  parser.add_argument("--fault_offset", type=int, default=25, help="steps into each interval")
  parser.add_argument("--rejoin_after", type=int, default=10, help="embedded drills")
  parser.add_argument("--checkpoint_every", type=int, default=50, help="every side's")
  parser.add_argument("--microbatches", type=int, default=1, help="faults: per pod")
  parser.add_argument("--global_batch", type=int, default=12, help="faults: rows per step")
  parser.add_argument("--fault_blocks", type=int, default=3, help="faults: blocks of sides")
  parser.add_argument("--sides", default=",".join(SIDES), help="faults: of " + ",".join(SIDES))
  parser.add_argument(
    "--progress_timeout_s", type=float, default=10.0, help="faults: the wedged side's bound"
  )
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
