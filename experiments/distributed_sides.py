"""The sides bench_distributed.py compares, as processes that stay up and run blocks on command.

A `Side` is one job (a config's step built once) in `nproc` processes of one simulated CPU
device each (distributed mode, `python -m pwtrain.launch` style: a loopback coordinator), or in
one process of `devices` devices. Each process pins itself to a core of its own (process i to
core i mod the cores; a one-process side to the first), builds its step, reports how long its
compiles took, and then runs what the benchmark sends on its stdin, one command a line:
  block  `steps` steps, timed from the first dispatch to the last step's metrics and the end of
         everything dispatched: seconds per step, and the last step's loss
  trace  one more step alone, traced: the live bytes before it and at its peak, and the events
         of this process's computations and transfers on the machine's monotonic clock
  quit
A side waits for its command; only the side asked runs, so sides can be interleaved block by
block (bench_distributed.interleaved) and each block of one side runs on an otherwise quiet
machine. No persistent compilation cache: every process compiles what it compiles.

Run as a script only by `Side` (`--job=<JSON>`).
"""

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = "--xla_force_host_platform_device_count={n} --xla_cpu_multi_thread_eigen=false"
REPLY = "@bench "  # the prefix of a worker's answers on its stdout (libraries may print too)
STAGE_PIECES = ("F", "B", "FB")  # a pipeline stage's pieces (parallel/pipeline/pieces.py)


class Side:
  """One job's processes (module docstring). `ready`: each process's build report (`worker`);
  `ask(command)`: every process's answer to it."""

  def __init__(
    self,
    name: str,
    nproc: int,
    overrides: dict,
    steps: int,
    *,
    devices: int = 1,
    trace: str = "",
    compile_everywhere: bool = False,
    timeout_s: float = 1200.0,
  ):
    from pwtrain import launch

    self.name, self.timeout_s = name, timeout_s
    job = {"nproc": nproc, "overrides": overrides, "steps": steps, "trace": trace}
    job["compile_everywhere"] = compile_everywhere
    port = launch.free_port()
    self.procs, self.logs, self.replies = [], [], []
    for i in range(nproc):
      env = launch.child_env(i, nproc, f"127.0.0.1:{port}", 1) if nproc > 1 else dict(os.environ)
      env["XLA_FLAGS"] = ONE_THREAD.format(n=1 if nproc > 1 else devices)
      env["JAX_PLATFORMS"] = "cpu"
      env.pop("JAX_COMPILATION_CACHE_DIR", None)
      log = tempfile.TemporaryFile()
      command = [sys.executable, os.path.abspath(__file__), f"--job={json.dumps(job)}"]
      proc = subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
      )
      replies: queue.Queue = queue.Queue()
      threading.Thread(target=_read_replies, args=(proc.stdout, replies), daemon=True).start()
      self.procs.append(proc)
      self.logs.append(log)
      self.replies.append(replies)
    self.ready = self._answers()

  def ask(self, command: str) -> list[dict]:
    for proc in self.procs:
      proc.stdin.write(command + "\n")
      proc.stdin.flush()
    return self._answers()

  def _answers(self) -> list[dict]:
    deadline = time.monotonic() + self.timeout_s
    out = []
    for index, (proc, replies) in enumerate(zip(self.procs, self.replies, strict=True)):
      while True:
        try:
          out.append(replies.get(timeout=1.0))
          break
        except queue.Empty:
          if proc.poll() is not None or time.monotonic() > deadline:
            log = self._log(index)
            self.close()
            raise RuntimeError(f"{self.name}: process {index} failed:\n{log}") from None
    return out

  def _log(self, index: int) -> str:
    self.logs[index].seek(0)
    return self.logs[index].read().decode(errors="replace")[-3000:]

  def close(self) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        try:
          proc.stdin.write("quit\n")
          proc.stdin.flush()
        except OSError:
          pass
    for proc in self.procs:
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for log in self.logs:
      log.close()


def _read_replies(stream, replies: queue.Queue) -> None:
  for line in stream:
    if line.startswith(REPLY):
      replies.put(json.loads(line[len(REPLY) :]))


def compile_report(compiles: list[dict]) -> dict:
  """Seconds (wall and CPU) of this process's Controller.compile calls, summed by what they
  compiled: the stage pieces (F, B, FB) and the others, each of this process's islands and of
  other processes' islands."""
  out = {}
  for c in compiles:
    kind = re.fullmatch(r"\d+:([A-Za-z]+)\d+", c["name"])
    group = "stage" if kind and kind.group(1) in STAGE_PIECES else "other"
    where = "here" if c["here"] else "elsewhere"
    for clock in ("wall", "cpu"):
      key = f"{group}_{where}_{clock}_s"
      out[key] = out.get(key, 0.0) + c[clock]
    key = f"{group}_{where}_compiled"  # how many calls compiled (the rest only traced)
    out[key] = out.get(key, 0) + (not c["outlined"])
  return out


# -- one process's part -------------------------------------------------------------------------


def worker(job: dict) -> None:
  """Builds the job's step, reports its compiles, then answers commands (module docstring)."""
  # One core per process (os.sched_setaffinity): XLA:CPU sizes its thread pool by the cores
  # it may use, and its flags do not pin it to one thread (measured: 2 cores busy either way).
  index = int(os.environ.get("PWTRAIN_PROCESS_ID", "0"))
  cores = sorted(os.sched_getaffinity(0))
  os.sched_setaffinity(0, {cores[index % len(cores)]})
  sys.path.insert(0, REPO)
  import ml_collections

  from pwtrain import config as config_lib
  from pwtrain.backend import distributed

  if job["nproc"] > 1:
    distributed.initialize(ml_collections.ConfigDict({"connect_timeout_s": 60}))
  import numpy as np

  from pwtrain.backend import Controller
  from pwtrain.backend.outline import Outline
  from pwtrain.backend.pulls import PullDeadlines
  from pwtrain.harness import Harness
  from pwtrain.parallel import plan as plan_lib

  config = config_lib.load(os.path.join(REPO, "configs", "palm_tiny.py"), job["overrides"])
  trace = live_bytes_trace() if job.get("trace") else None
  cluster = plan_lib.make_cluster(config)
  controller = Controller(
    cluster,
    max_inflight=config.backend.max_inflight_steps,
    trace=trace,
    pulls=PullDeadlines(config.backend.pull_timeout_s),
    compile_everywhere=job["compile_everywhere"],
  )
  compiles = []
  compile = controller.compile

  def timed_compile(name, fn, island, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    exe = compile(name, fn, island, *args, **kwargs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    here, outlined = controller.runs_here(island), isinstance(exe.compiled, Outline)
    compiles.append(dict(name=name, here=here, outlined=outlined, wall=wall, cpu=cpu))
    return exe

  controller.compile = timed_compile
  cpu = time.process_time()
  harness = Harness.build(config, cluster=cluster, controller=controller)
  build = {"compile_wall_s": harness.compile_s, "compile_cpu_s": time.process_time() - cpu}
  reply({**build, **compile_report(compiles)})

  batch_shape = (config.train.global_batch, config.data.seq_len)
  rng = np.random.default_rng(0)
  batch = {
    "inputs": rng.integers(0, 256, batch_shape).astype(np.int32),
    "targets": rng.integers(0, 256, batch_shape).astype(np.int32),
  }
  state, step = harness.init(), 0
  for command in sys.stdin:
    command = command.strip()
    if command == "block":
      start = time.perf_counter()
      for _ in range(job["steps"]):
        out = harness.step(state, batch, step)
        state, step = out.state, step + 1
      metrics = out.metrics.result()  # the block's last step has finished (its metrics exist)
      harness.controller.wait()
      seconds = (time.perf_counter() - start) / job["steps"]
      loss = metrics.get("loss") if isinstance(metrics, dict) else None
      reply({"seconds": seconds, "loss": None if loss is None else float(np.asarray(loss))})
    elif command == "trace":
      result, state, step = traced_step(harness, trace, state, batch, step)
      reply(result)
    elif command == "quit":
      break
  controller.wait()
  harness.close()
  controller.close()


def reply(answer: dict) -> None:
  print(REPLY + json.dumps(answer), flush=True)


def traced_step(harness, trace, state, batch, step) -> tuple[dict, dict, int]:
  """One step alone, with its events and live bytes: (figures, the next state, step + 1)."""
  before = trace.reset_peak()
  last = len(trace.events)
  out = harness.step(state, batch, step)
  out.metrics.result()
  harness.controller.wait()
  events = trace.events[last:]
  deadline = time.monotonic() + 60  # transfers of carried values (stale) may still run
  while any(e.done is None for e in events) and time.monotonic() < deadline:
    time.sleep(0.01)
  # This process's own computations and the transfers it takes part in, on the machine-wide
  # monotonic clock (time.perf_counter), so that the processes' events compare.
  t0 = trace.zero
  result = {"live_bytes_before": before, "peak_live_bytes": trace.peak}
  result["events"] = [
    {"name": e.name, "island": e.island, "launch": t0 + e.launch, "done": t0 + e.done}
    for e in events
    if e.launch is not None and e.done is not None
  ]
  return result, out.state, step + 1


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


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--job", required=True, help="the job, as JSON (Side makes it)")
  worker(json.loads(parser.parse_args().job))
