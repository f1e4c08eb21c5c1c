"""What the scripts in experiments/ share: simulated devices, config loading with --set, random
batches, a harness-driven `Side` to time, and the machine facts and JSON every result records.

Each script imports this module first and calls `force_host_devices` before it imports JAX;
this module itself imports JAX and pwtrain only inside functions, so that order holds.
"""

import ast
import contextlib
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import tempfile
import time
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]


def force_host_devices(num: int) -> None:
  """Makes XLA's CPU backend simulate `num` devices (replacing any device count already in
  XLA_FLAGS), adds pwtrain's CPU numerics flag as its commands do (platforms.with_cpu_numerics)
  and selects the CPU platform unless JAX_PLATFORMS says otherwise. Must run before JAX is
  imported."""
  from pwtrain import platforms  # imports no JAX

  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
  flags = f"{flags} --xla_force_host_platform_device_count={num}"
  os.environ["XLA_FLAGS"] = platforms.with_cpu_numerics(flags)  # as pwtrain's commands run
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# -- configs --------------------------------------------------------------------------------------

# The comparison model of the scale benchmarks (issue-style "comparison config"): 4 layers,
# d_model 256, 8 heads of 32 with one shared key/value head (multi-query), d_ff 1024. Each
# benchmark adds its sequence length, batch and optimizer.
COMPARISON_MODEL = {
  "model.num_layers": 4,
  "model.d_model": 256,
  "model.num_heads": 8,
  "model.num_kv_heads": 1,
  "model.head_dim": 32,
  "model.d_ff": 1024,
}


def add_config_args(parser, default: str = "palm_tiny") -> None:
  """--config (a shipped config's name or a config file; default `default`) and repeatable
  --set KEY=VALUE."""
  parser.add_argument("--config", default=default)
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="config override, e.g. parallel.data=8 (repeatable; VALUE is a Python literal or text)",
  )


def parse_sets(items: list[str]) -> dict:
  """["parallel.data=8", "exchange.mode=sync"] -> {"parallel.data": 8, "exchange.mode": "sync"}:
  each VALUE is read as a Python literal (8, 1.5, True, None, (1, 2)), else kept as text."""
  out = {}
  for item in items:
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"--set {item!r} must be KEY=VALUE")
    try:
      out[key.strip()] = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
      out[key.strip()] = text.strip()
  return out


def load_config(config: str, overrides: dict | None = None):
  """pwtrain.config.load of `config` (a shipped config's name or a file) with `overrides`
  {"section.key": value}, checked by pwtrain.config.validate."""
  from pwtrain import config as config_lib

  loaded = config_lib.load(config, overrides)
  config_lib.validate(loaded)
  return loaded


def random_batches(config, num: int, seed: int = 0, high: int | None = None) -> list[dict]:
  """`num` host batches {"inputs", "targets"} of uniform random tokens in [1, high) (default:
  model.vocab_size), global_batch x seq_len each; targets are inputs shifted by one."""
  import numpy as np

  rng = np.random.default_rng(seed)
  shape = (config.train.global_batch, config.data.seq_len + 1)
  out = []
  for _ in range(num):
    tokens = rng.integers(1, high or config.model.vocab_size, size=shape).astype(np.int32)
    out.append({"inputs": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy()})
  return out


# -- timing a step --------------------------------------------------------------------------------


class NodeTime(NamedTuple):
  island: str
  seconds: float


class Side:
  """A `pwtrain.harness.Harness` with its train state threaded from block to block over fixed
  host batches (cycled), driven as pwtrain.train drives it: step i is `program_for(i)`,
  dispatched without waiting, `backend.max_inflight_steps` in flight.

  `time_state`: a timed block ends when every output of its last step is ready; False: when the
  last step's metrics are on the host (remote state would have to be fetched to be waited on).
  """

  def __init__(self, harness, batches: list[dict], *, time_state: bool = True):
    self.harness, self.batches, self.time_state = harness, batches, time_state
    self.state, self.i = harness.init(), 0
    self.last_metrics = None  # the future of the last step's metrics

  @property
  def step_program(self):
    return self.harness.step_program

  def _batch(self) -> dict:
    batch = self.batches[self.i % len(self.batches)]
    self.i += 1
    return batch

  def run(self, n: int, program=None) -> float:
    """Seconds per step over `n` steps, from the first dispatch to the last step's outputs.

    `program`: run this one for every step (default: `program_for(step)`).
    """
    import jax

    start = time.perf_counter()
    for _ in range(n):
      step = self.i
      out = self.harness.step(self.state, self._batch(), step, program=program)
      self.state, self.last_metrics = out.state, out.metrics
    waited = [out.metrics, *out.state.values()] if self.time_state else [out.metrics]
    jax.block_until_ready([f.result() for f in waited])
    elapsed = time.perf_counter() - start
    self.harness.controller.wait()  # all done already: drains the in-flight bound, untimed
    return elapsed / n

  def profile(self, program=None) -> dict[str, NodeTime]:
    """One step node by node in program order, blocking on each: {node name: NodeTime}."""
    import jax

    from pwtrain.backend import Node, Transfer

    sp = self.step_program
    program = program or sp.program_for(self.i)
    state = {k: v.result() if hasattr(v, "result") else v for k, v in self.state.items()}
    inputs, values, times = {**state, **sp.feed(self._batch())}, {}, {}

    def get(ref):
      if isinstance(ref, str):
        return inputs[ref]
      value = values[ref[0]]
      return value[ref[1]] if isinstance(value, tuple) else value

    for node in program.nodes:
      t = time.perf_counter()
      if isinstance(node, Node):
        out = node.executable.compiled(*[get(r) for r in node.args])
      else:
        assert isinstance(node, Transfer)
        out = jax.device_put(get(node.src), node.sharding)
      jax.block_until_ready(out)
      times[node.name] = NodeTime(node.island, time.perf_counter() - t)
      values[node.name] = out
    self.state = {k: get(program.outputs[k]) for k in sp.state_keys}
    return times

  def close(self) -> None:
    self.harness.close()


# -- exchange overlap from a trace ----------------------------------------------------------------

# Node names of the pod programs (parallel/pods.py): pod p's backward pieces, and the exchange
# work its island runs (gradients from pod q arriving, p's reduction and encoding).
BACKWARD = re.compile(r"^(\d+):(FB|B)\d+\.\d+$")
EXCHANGE = re.compile(r"^(?:\d+>(\d+):g\d+|(\d+):(?:reduce|enc)\d+)$")


def exchange_overlap(events: list, serialized: bool) -> dict:
  """Exchange work started / finished / run before each pod's backward ends, averaged over pods.

  Each event's start: serialized, its `launch` stamp (taken just before it ran, with nothing
  else running); concurrent, the later of its launch and the previous end on its island (a launch
  is asynchronous: the computation waits for the island's earlier ones). Its end is its `done`
  stamp either way.
  """
  start, prev_island = {}, {}
  for e in sorted(events, key=lambda e: e.launch):
    start[e.name] = e.launch if serialized else max(e.launch, prev_island.get(e.island, e.launch))
    prev_island[e.island] = e.done
  end = {e.name: e.done for e in events}
  pods = sorted({int(m.group(1)) for e in events if (m := BACKWARD.match(e.name))})
  per_pod = []
  for p in pods:
    bwd_end = max(end[e.name] for e in events if (m := BACKWARD.match(e.name)) and int(m[1]) == p)
    work = [e.name for e in events if (m := EXCHANGE.match(e.name)) and int(m[1] or m[2]) == p]
    if not work:
      continue
    total = sum(max(end[n] - start[n], 0.0) for n in work)
    before = sum(max(min(end[n], bwd_end) - start[n], 0.0) for n in work)
    per_pod.append(
      {
        "pod": p,
        "nodes": len(work),
        "started_before": sum(start[n] < bwd_end for n in work) / len(work),
        "finished_before": sum(end[n] <= bwd_end for n in work) / len(work),
        "hidden_time": before / total if total > 0 else 0.0,
        "exchange_ms": total * 1e3,
        "order": [n for n in sorted(start, key=start.get) if n in work or n.startswith(f"{p}:")],
      }
    )
  keys = ("started_before", "finished_before", "hidden_time", "exchange_ms")
  mean = {k: statistics.mean(r[k] for r in per_pod) for k in keys} if per_pod else {}
  return {**mean, "per_pod": per_pod}


def median_ms(seconds: list[float]) -> float:
  return statistics.median(seconds) * 1e3


@contextlib.contextmanager
def compile_cache(directory: str | None, prefix: str):
  """JAX's persistent compilation cache in `directory` (kept), or in a fresh temporary one
  (removed at the end), for every program however small: pieces shared by several sides
  (init, optimizer update, ...) then compile once."""
  import jax

  cache = directory or tempfile.mkdtemp(prefix=prefix)
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  try:
    yield cache
  finally:
    if directory is None:
      shutil.rmtree(cache, ignore_errors=True)


# -- what a result records ------------------------------------------------------------------------


def machine() -> dict:
  """The devices and host a result was measured on."""
  import jax

  return {
    "devices": len(jax.devices()),
    "platform": jax.devices()[0].platform,
    "cpu_count": os.cpu_count(),
    "host": platform.node(),
    "jax": jax.__version__,
  }


def source_sha256(module) -> str:
  """The first 12 hex digits of the SHA-256 of `module`'s source file: which version ran."""
  import hashlib

  return hashlib.sha256(pathlib.Path(module.__file__).read_bytes()).hexdigest()[:12]


class Load:
  """The machine's load average from construction to `report()`: other processes on a shared
  machine slow the timings."""

  def __init__(self):
    self.start = os.getloadavg()

  def report(self) -> dict:
    """Prints a warning if the load exceeded the core count; {"loadavg_start", "loadavg_end"}."""
    end = os.getloadavg()
    worst = max(self.start[0], end[0])
    if worst > (os.cpu_count() or 1):
      print(f"warning: load average {worst:.1f} > {os.cpu_count()} cores: other processes ran")
    return {"loadavg_start": self.start, "loadavg_end": end}


def write_json(path: str, result: dict) -> None:
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")
