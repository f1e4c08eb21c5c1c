"""Compile the real step for a TPU topology on this host: `--dry_run --compile`.

With libtpu installed (the optional `[tpu]` extra), JAX describes a TPU topology without TPUs
(jax.experimental.topologies) and compiles for its devices. `compile_for_topology(config)`
builds the run's own Harness, the step program train.run compiles (the config's layout,
model.scan_layers, model.remat, model.dtype and train.num_microbatches), on the devices of
`hardware.topology`: one slice of that topology per pod, so pods are slices as on a multi-slice
cluster and islands never span slices (backend/cluster.py). Nothing runs and no array is
allocated; the compiled executables are only read.

Pods. libtpu compiles for a multi-slice topology only programs that involve its slice 0 (a
program on slice 1's devices alone fails with "Slice is empty"). Every pod runs the same
functions on equal meshes, so after the islands are carved from the slices (which checks that
the layout can be placed), each pod's islands are compiled on the devices of pod 0's: the
figures are slice 0's, and stand for every slice's.

Per island of pod 0 (every pod's are the same), per device, from XLA's compiled programs:

  memory   an executable's live bytes are its arguments + temporaries + outputs - the outputs
           aliased to donated arguments (memory_analysis). An island that runs its whole step in
           one executable (one SPMD island: `train_step`, whose arguments hold the whole train
           state) peaks at exactly that executable's live bytes, by XLA's accounting. An island
           that runs several pieces (pods and pipeline stages, parallel/pipeline/pieces.py)
           holds its train state (the outputs of its init) across them, and a pipeline stage
           also what it keeps between its pieces for the microbatches in flight (the
           schedule's peak count, parallel/pipeline/schedule.py): each one's F outputs (its
           residuals at stage_remat="none", the activation it sends) and, after the first
           stage, the input activation it received. Its peak is bounded above by the state,
           plus what it keeps between pieces, plus the largest piece's live bytes (state a
           piece reads is counted twice, an activation already sent still once).
           `fits` compares that figure with the hardware's memory_bytes.
  FLOPs    per step: XLA's cost analysis of every executable, times how often the step program
           runs it. XLA counts a loop's body once, whatever its trip count, so a step with loops
           (scanned layers; one island's microbatch accumulation) is counted from the same
           step compiled unrolled, with one microbatch, at one and two periods of layers and at
           one and two microbatches' worth of sequences. Their counts are linear (up to XLA's
           padding of small dimensions to TPU tiles): A + b * (B + p * C) for p periods and b
           microbatches' sequences (A: the update, once per step; B: embedding, head and loss;
           C: one period of blocks), which gives the step's A + M * (B + periods * C). That is
           an extrapolation of compiled counts, labelled so in the report. Pipeline stages with
           loops are reported as XLA counts them, labelled "loop bodies counted once".

Next to each figure is the analytic estimate of the same quantity (dryrun.estimate).
"""

import dataclasses
import importlib.util
import math
import os
import time

import jax

from pwtrain import dryrun
from pwtrain import sharding as sharding_lib
from pwtrain.backend import Node
from pwtrain.backend.cluster import Cluster, Island
from pwtrain.errors import ConfigError
from pwtrain.harness import Harness
from pwtrain.models import scan as scan_lib
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel.pipeline import pieces as pieces_lib
from pwtrain.parallel.pipeline import schedule as schedule_lib

MEGACORE = ("v4", "v5p")  # TPU generations whose two cores per chip make one JAX device


@dataclasses.dataclass(frozen=True)
class Piece:
  """One compiled executable of an island, per device."""

  name: str
  runs: int  # times the step program runs it per step (0: init)
  arguments: int
  temporaries: int
  outputs: int
  aliased: int
  flops: float  # XLA's cost analysis, one run (loop bodies counted once)

  @property
  def live(self) -> int:
    return self.arguments + self.temporaries + self.outputs - self.aliased


def topology_devices(config) -> list:
  """The compile-only devices of `hardware.topology`, one slice per pod (parallel.pods)."""
  hw = dryrun.hardware(config)
  if not hw.topology:
    raise ConfigError(
      "--dry_run --compile needs hardware.topology, the TPU topology of one slice (one pod), "
      "e.g. --config.hardware.topology=v4:4x4x4 (needs a `hardware` section; see "
      "pwtrain/configs/palm_540b.py)"
    )
  if importlib.util.find_spec("libtpu") is None:
    raise SystemExit(
      "--dry_run --compile compiles for TPUs with libtpu, which is not installed: "
      "pip install 'pwtrain[tpu]'"
    )
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM metadata to ask
  # libtpu locks /tmp/libtpu_lockfile so that one process owns a host's TPUs; compiling owns
  # none, so several processes (a test and the CLI it starts, two dry runs) may each load it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  kwargs = {"chip_config_name": "megacore"} if hw.topology.split(":")[0] in MEGACORE else {}
  if config.parallel.pods > 1:
    kwargs["num_slices"] = config.parallel.pods
  try:
    return list(topologies.get_topology_desc(hw.topology, "tpu", **kwargs).devices)
  except Exception as e:  # libtpu's message is one line: keep it, name the setting
    raise ConfigError(f"hardware.topology={hw.topology!r} is not a TPU topology: {e}") from None


def _cluster(config, devices) -> Cluster:
  """The islands carved from the topology's slices, every pod's on slice 0's devices (module
  docstring: libtpu compiles no program of slice 1 alone)."""
  cluster = plan_lib.make_cluster(config, devices)
  per_slice = len(cluster.islands) // config.parallel.pods
  return Cluster(
    tuple(
      Island(island.name, cluster.islands[k % per_slice].devices)
      for k, island in enumerate(cluster.islands)
    )
  )


def _pieces(harness: Harness) -> dict[str, list[Piece]]:
  """island -> its executables as Pieces (memory per device, XLA's FLOPs, runs per step)."""
  program = harness.step_program
  runs = {}
  for node in program.program.nodes:
    if isinstance(node, Node):
      runs[id(node.executable)] = runs.get(id(node.executable), 0) + 1
  islands: dict[str, list[Piece]] = {}
  for key, exe in program.executables.items():
    m = exe.memory_analysis()
    cost = exe.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    piece = Piece(
      name=key if isinstance(key, str) else ":".join(map(str, key)),
      runs=runs.get(id(exe), 0),
      arguments=m.argument_size_in_bytes,
      temporaries=m.temp_size_in_bytes,
      outputs=m.output_size_in_bytes,
      aliased=m.alias_size_in_bytes,
      flops=float((cost or {}).get("flops", 0.0)),
    )
    islands.setdefault(exe.island, []).append(piece)
  return islands


def _step_flops(pieces: list[Piece]) -> float:
  return sum(p.flops * p.runs for p in pieces)


def _has_loops(config) -> bool:
  spmd_microbatches = config.parallel.stages == 1 and config.parallel.pods == 1
  return config.model.scan_layers or (spmd_microbatches and config.train.num_microbatches > 1)


def _compiled_flops(config, devices) -> dict | None:
  """island -> FLOPs per device per step extrapolated from loop-free compiles (module
  docstring), for a step with loops on islands that hold whole models; None otherwise."""
  if not _has_loops(config) or config.parallel.stages > 1:
    return None
  period, micro = scan_lib.period(config.model, config.moe), config.train.num_microbatches
  batch = config.train.global_batch // micro  # one microbatch's sequences

  def count(periods: int, microbatches: int) -> dict:
    variant = config.copy_and_resolve_references()
    with variant.unlocked():
      variant.model.num_layers = periods * period
      variant.model.scan_layers = False
      variant.train.num_microbatches = 1
      variant.train.global_batch = microbatches * batch
    with Harness.build(variant, cluster=_cluster(variant, devices)) as harness:
      return {i: _step_flops(p) for i, p in _pieces(harness).items()}

  f11, f21 = count(1, 1), count(2, 1)
  f12 = count(1, 2) if micro > 1 else f11
  n = config.model.num_layers // period
  out = {}
  for i in f11:
    per_period = f21[i] - f11[i]  # C: one period, one microbatch
    outside = f12[i] - f11[i] - per_period if micro > 1 else 0.0  # B: embed, head, loss
    fixed = f11[i] - outside - per_period  # A: the update, once per step
    out[i] = fixed + micro * (outside + n * per_period)
  return out


def compile_for_topology(config) -> dict:
  """The config's step compiled for `hardware.topology`: per island of pod 0, the compiled
  memory and FLOPs per device next to the analytic estimate (module docstring), as numbers."""
  estimate = dryrun.estimate(config)  # validates the config
  devices = topology_devices(config)
  out = {
    "topology": dryrun.hardware(config).topology,
    "num_slices": config.parallel.pods,
    "num_devices": len(devices),
    "device_kind": devices[0].device_kind,
    "memory_bytes": estimate["hardware"]["memory_bytes"],
    "error": None,
    "islands": [],
  }
  start = time.perf_counter()
  try:
    with Harness.build(config, cluster=_cluster(config, devices)) as harness:
      islands = _pieces(harness)
      pod0 = [harness.plan.cells[(0, s)].name for s in range(harness.plan.num_stages)]
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # XLA refuses a program whose buffers exceed the device's memory: the layout does not fit.
    return out | {"compile_s": time.perf_counter() - start, "error": str(e).splitlines()[0]}
  out["compile_s"] = time.perf_counter() - start
  extrapolated = _compiled_flops(config, devices)
  out["flops_compile_s"] = time.perf_counter() - start - out["compile_s"]
  rows = out["islands"]
  tokens_per_pod = config.train.global_batch * config.data.seq_len // estimate["num_pods"]
  names = list(dict.fromkeys(pod0))  # an island's cells (exchange chunks) share its name
  for name, analytic in zip(names, estimate["islands"], strict=True):
    pieces = islands[name]
    init = [p for p in pieces if p.runs == 0 and p.name.split(":")[0] == "init"]
    step = [p for p in pieces if p.runs > 0]
    whole = len(step) == 1
    state = sum(p.outputs for p in init)
    held = _held_between_pieces(config, harness.plan, pod0.index(name), step)
    peak = max(p.live for p in step) + (0 if whole else state + held)
    if extrapolated is not None:
      flops, counted = extrapolated[name], "extrapolated from loop-free compiles"
    elif _has_loops(config):
      flops, counted = _step_flops(step), "loop bodies counted once"
    else:
      flops, counted = _step_flops(step), "as compiled"
    memory = out["memory_bytes"]
    rows.append(
      {
        "island": name,
        "pieces": [dataclasses.asdict(p) | {"live": p.live} for p in pieces],
        "state_bytes": state,
        "held_bytes": held,
        "peak_bytes": peak,
        "peak_is": "exact" if whole else "upper bound",
        "fits": None if memory is None else peak <= memory,
        "flops": flops,
        "flops_counted": counted,
        "analytic_bytes": analytic["bytes"],
        "analytic_fits": analytic["fits"],
        "analytic_flops": analytic["executed_flops_per_token"]
        * tokens_per_pod
        / estimate["devices_per_island"],
      }
    )
  return out


def _held_between_pieces(config, plan, stage_index: int, step: list) -> int:
  """Bytes per device a pipeline stage keeps between its pieces: per microbatch in flight at
  the schedule's peak, its F piece's outputs and (after the first stage) its input activation,
  as large as the activation F sends on. 0 where the island runs no F piece (one stage, or the
  last stage, whose FB keeps nothing between microbatches), except that a last stage whose
  backward is split (zero_bubble) keeps its FB's outputs and its input until its W; and a split
  stage before it that recomputes (stage_remat "full") keeps its B's residuals (B's outputs but
  the input's gradient) from B to W, for the schedule's peak of microbatches between them."""
  stage = plan.stages[stage_index] if config.parallel.stages > 1 else None
  split = stage is not None and schedule_lib.splits_backward(config.parallel.schedule, stage)
  kind = "FB" if stage is not None and stage.last and split else "F"
  f_piece = next((p for p in step if p.name == f"{kind}:0:{stage_index}"), None)
  if stage is None or f_piece is None:
    return 0
  order = schedule_lib.island_order(
    config.parallel.schedule, stage, plan.num_stages, config.train.num_microbatches,
    plan.virtual_stages,
  )  # fmt: skip
  act_in = 0
  if not stage.first:  # the received activation, as laid out on this island (pieces.ACT)
    micro = config.train.global_batch // plan.num_pods // config.train.num_microbatches
    shape = (micro, config.data.seq_len, config.model.d_model)
    sharding = sharding_lib.named_sharding(plan.mesh((0, stage_index)), pieces_lib.ACT)
    per_device = math.prod(sharding.shard_shape(shape))
    act_in = per_device * jax.numpy.dtype(config.model.dtype).itemsize
  held = schedule_lib.peak_live_inputs(order) * (f_piece.outputs + act_in)
  b_piece = next((p for p in step if p.name == f"B:0:{stage_index}"), None)
  if split and b_piece is not None:  # g_in is as large as the input activation
    held += schedule_lib.peak_pending_weights(order) * (b_piece.outputs - act_in)
  return held


_size = dryrun.size_text


def report(config) -> str:
  """The dry run's report followed by the compiled figures."""
  text = dryrun.report(config)
  c = compile_for_topology(config)
  slices = f" x {c['num_slices']} slices" if c["num_slices"] > 1 else ""
  target = f"{c['topology']}{slices} ({c['num_devices']} {c['device_kind']} devices)"
  if c["error"]:
    return (
      f"{text}\nCompiled for {target}: does NOT fit; XLA refused the step after "
      f"{c['compile_s']:.1f} s: {c['error']}"
    )
  lines = [
    text,
    f"Compiled for {target} in {c['compile_s']:.1f} s (+ {c['flops_compile_s']:.1f} s for the "
    "FLOP count):",
  ]
  memory = c["memory_bytes"]
  for r in c["islands"]:
    step = [p for p in r["pieces"] if p["runs"]]
    biggest = max(step, key=lambda p: p["live"])
    lines += [
      f"{r['island']}, per device (compiled; analytic in brackets):",
      f"  largest piece    {biggest['name']}: arguments {_size(biggest['arguments'])}, "
      f"temporaries {_size(biggest['temporaries'])}, outputs {_size(biggest['outputs'])} "
      f"(aliased {_size(biggest['aliased'])})",
    ]
    if r["peak_is"] != "exact":
      lines.append(f"  train state      {_size(r['state_bytes'])} (held across the pieces)")
    if r["held_bytes"]:
      lines.append(
        f"  between pieces   {_size(r['held_bytes'])} (F outputs and inputs of the "
        "microbatches in flight)"
      )
    lines += [
      f"  peak             {_size(r['peak_bytes'])} ({r['peak_is']}; {dryrun.fits_text(r['fits'])}"
      + ("" if memory is None else f" in {_size(memory)}")
      + f") [{_size(r['analytic_bytes'])}, {dryrun.fits_text(r['analytic_fits'])}]",
      f"  FLOPs per step   {r['flops']:.4g} ({r['flops_counted']}) [{r['analytic_flops']:.4g}; "
      f"compiled/analytic {r['flops'] / r['analytic_flops']:.3f}]",
    ]
  return "\n".join(lines)
