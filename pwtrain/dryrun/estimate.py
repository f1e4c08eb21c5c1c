"""The cost model: memory per device and time per step of a config's plan, with no devices.

`estimate(config)` plans `parallel.*` on virtual islands (device ids, no devices) with
plan.build, so the layout (mesh, cells, their islands) and the exchange are the plan's; builds
the train state's shapes abstractly (shapes.py); and costs one step. Everything is arithmetic,
so PaLM 540B on 6144 TPU v4 chips plans in a second on a laptop. Byte counts are per device
unless named otherwise; times are seconds per step. Every pod's islands are alike, so pod 0's
describe all. Per device, with the model arithmetic of models/arithmetic.py:
  state         params, optimizer state and the exchange's state (each leaf's shard, as the run
                shards it), a running gradient sum the size of the params, and the received
                pods' encoded gradients (exchange.received_copies() copies).
  activations   tokens per device and microbatch (train.num_microbatches, as configured) x
                (layers x what a block keeps under model.remat, models/arithmetic.py, + one block's
                whole set (arithmetic.layer_activation_bytes: the one being recomputed for its
                backward; with remat "none" every block of an unrolled model keeps it, a
                scanned model's keep their matmul outputs) + the head's, on the last
                stage) + the stage inputs a pipeline stage holds for its backward
                (schedule.peak_live_inputs), and at parallel.stage_remat="none" what its
                blocks keep, per microbatch in flight.
  compute       the FLOPs the hardware executes / (devices x peak x hardware.efficiency), times
                the pipeline bubble (Setup.bubble: (M + S - 1) / M for gpipe and 1f1b,
                counted from the schedule for the others). Executed FLOPs = the model's
                (arithmetic.layer_costs) + what model.remat recomputes (models/arithmetic.py) + a
                pipeline stage's forward again in its backward (every stage but the last, at
                parallel.stage_remat="full": its B piece recomputes the stage from its input,
                1/3 of the stage's training FLOPs).
                hardware.efficiency is a stated assumption (hardware.py), so the step time and
                MFU are predictions from it, not measurements fed back.
  collectives   FSDP gathers and scatters and tensor all-reduces inside an island, at the ICI
                bandwidth, assumed hidden under compute (the report says when they could not be).
  cross-pod     exchange.bytes_per_step: each host sends its devices' share, bytes / hosts per
                island, at the host's DCN bandwidth; the step waits for exchange.exposed_s of it.
  step          compute + exposed transfer; MFU = tokens x arithmetic.flops_per_token / (step x
                all devices x peak).
"""

import dataclasses
import itertools

import jax

from pwtrain import config as config_lib
from pwtrain.dryrun import shapes
from pwtrain.dryrun.inputs import Setup, island_stages, setup
from pwtrain.models import arithmetic, family
from pwtrain.parallel import pipeline
from pwtrain.parallel.stages import Stage, to_stage

# A pipeline stage's backward (its B piece) recomputes the stage's forward from its saved input
# (parallel.stage_remat="full"):
# forward = 1/3 of the training FLOPs (2 of 6 per parameter and token; 4 of 12 LHKT).
PIPELINE_RECOMPUTE = 1.0 / 3.0
# Remat policies from the most activation memory kept to the least (models/remat.py).
REMAT_BY_MEMORY = ("none", "dots", "outputs", "full")

MODEL_STATE_KEYS = ("params", "opt_state")
OTHER_STATE_KEYS = ("step", "rng")  # every other key of the train state is the exchange's


# -- per-island state bytes ----------------------------------------------------------------------


def sent_per_pod_pair(exchange, stage_grads: list) -> int:
  """Bytes one pod sends one other pod per (outer) step for these cells' gradients."""
  if exchange.num_pods == 1:
    return 0
  return exchange.bytes_per_step(stage_grads) // (exchange.num_pods - 1)


def state_bytes(s: Setup, stage_list: list[Stage]) -> dict:
  """One device's bytes of an island's share of the train state, the gradient running sums
  and the received pods' gradients; `params` and `gradient_bytes_per_pod` are whole counts."""
  exchange = s.plan.exchange
  row = dict.fromkeys(
    ("params", "param_bytes", "optimizer_bytes", "exchange_state_bytes", "other_state_bytes"), 0
  )
  row |= {"exchange_buffer_bytes": 0, "gradient_bytes_per_pod": 0}
  for stage in stage_list:
    grads = to_stage(s.whole, stage)["params"]
    device = shapes.stage_device_bytes(s.whole, s.fns, stage, s.plan.mesh_shape)
    row["params"] += sum(x.size for x in jax.tree.leaves(grads))
    row["param_bytes"] += device["params"]
    row["optimizer_bytes"] += device["opt_state"]
    row["other_state_bytes"] += sum(device[k] for k in OTHER_STATE_KEYS)
    row["exchange_state_bytes"] += sum(
      n for k, n in device.items() if k not in MODEL_STATE_KEYS + OTHER_STATE_KEYS
    )
    # As the step program counts it: each cell's gradients (both copies of the shared
    # embedding under pipelining), encoded.
    sent = sent_per_pod_pair(exchange, [grads])
    row["gradient_bytes_per_pod"] += sent
    if sent:  # received pods' encoded gradients, per device
      ratio = sent / shapes.tree_bytes(grads)
      row["exchange_buffer_bytes"] += round(exchange.received_copies() * ratio * device["params"])
  row["gradient_buffer_bytes"] = row["param_bytes"]  # running sums, in the params' dtype
  row["state_bytes"] = sum(
    row[k]
    for k in (
      "param_bytes",
      "optimizer_bytes",
      "exchange_state_bytes",
      "other_state_bytes",
      "gradient_buffer_bytes",
      "exchange_buffer_bytes",
    )
  )
  return row


# -- activations ---------------------------------------------------------------------------------


def keeps_every_intermediate(m, remat: str) -> bool:
  """Whether every block keeps its whole set (arithmetic.layer_activation_bytes): unrolled at
  remat "none"."""
  return remat == "none" and not m.scan_layers


def activation_bytes(
  s: Setup, stage_list: list[Stage], num_micro: int, remat: str, stage_remat: str
) -> float:
  """Activation bytes per device of one island's cells at `num_micro` microbatches, when every
  block keeps what `remat` keeps (activations.kept_bytes_per_token).

  A pipeline stage that is not the last holds, per microbatch in flight (schedule's
  peak_live_inputs), its input (int32 tokens on the first stage) and, at `stage_remat`="none",
  what its blocks keep for the backward (less the first block's input on a later stage: that
  is the stage's input); at "full" its B piece recomputes that for one microbatch at a time.
  Where zero_bubble splits the backward, what B (FB on the last stage, the head's with it)
  keeps for W is held from B to W (peak_pending_weights) at "full", and on the last stage."""
  m, plan = s.config.model, s.plan
  tensor, seq_len = plan.mesh_shape["tensor"], s.config.data.seq_len
  layer = arithmetic.layer_activation_bytes(m, tensor, seq_len)
  kept_per_layer = arithmetic.remat_kept_bytes(m, tensor, seq_len, remat)
  keep_all = keeps_every_intermediate(m, remat)
  live, working, kept = 0.0, 0.0, 0.0
  for stage in stage_list:
    head = arithmetic.head_activation_bytes(m, tensor) if stage.last else 0.0
    blocks = stage.num_layers * (layer if keep_all else kept_per_layer)  # one microbatch's
    once = blocks  # kept for the one microbatch in its backward
    schedule = s.config.parallel.schedule
    split = pipeline.splits_backward(schedule, stage)  # zero_bubble: the last stage holds too
    if plan.num_stages > 1 and (not stage.last or split):
      order = pipeline.island_order(
        schedule, stage, plan.num_stages, num_micro, plan.virtual_stages
      )
      stage_input = 4 if stage.first else arithmetic.layer_input_bytes(m)
      per_micro = stage_input  # held from the microbatch's F to its B (W where split)
      residuals = blocks - (0.0 if stage.first else stage_input)  # the input is held already
      if stage_remat == "none" and not stage.last:  # F's residuals, held to B (and W)
        per_micro += residuals
        once = 0.0
      live += pipeline.peak_live_inputs(order) * per_micro
      if split and (stage.last or stage_remat == "full"):  # B's (FB's) residuals, held to W
        live += pipeline.peak_pending_weights(order) * (residuals + head)
        once = 0.0
    if keep_all:
      working = max(working, once + head)
    else:  # every block keeps its share; the one in its backward has its whole set live
      kept += once
      working = max(working, layer + head)
  return s.tokens_per_device(num_micro) * (live + kept + working)


def gathered(s: Setup, stage_list: list[Stage]) -> float:
  """FSDP-gathered weights and their unreduced gradients per device (arithmetic.gathered_bytes);
  none without an fsdp axis."""
  shape, m = s.plan.mesh_shape, s.config.model
  if shape["fsdp"] == 1:
    return 0.0
  layers = [layer for st in stage_list for layer in range(st.start, st.stop)]
  embedding = any(st.first or st.last for st in stage_list)
  padded = m.copy_and_resolve_references()
  padded.vocab_size = shapes.padded_vocab_size(m.vocab_size, shape["tensor"])
  return arithmetic.gathered_bytes(
    padded, s.config.moe, layers, embedding, shape["tensor"], shape["expert"]
  )


def to_fit(s: Setup, stage_list: list[Stage], state: int) -> dict | None:
  """The first remat policy, from the configured one towards "full" (in REMAT_BY_MEMORY order),
  with a number of microbatches that fits, and the smallest such train.num_microbatches, at the
  configured parallel.stage_remat, then (a pipeline at "none") at "full": {"remat",
  "num_microbatches", "stage_remat"}; None when none fits or the capacity is unknown."""
  if s.hw.memory_bytes is None:
    return None
  per_pod = s.config.train.global_batch // s.plan.num_pods // s.plan.batch_shards
  order = REMAT_BY_MEMORY[REMAT_BY_MEMORY.index(s.config.model.remat) :]
  stage_remats = [s.config.parallel.stage_remat]
  if s.plan.num_stages > 1 and stage_remats[0] == "none":
    stage_remats.append("full")
  micros = [micro for micro in range(1, per_pod + 1) if per_pod % micro == 0]
  for stage_remat, remat, micro in itertools.product(stage_remats, order, micros):
    if state + activation_bytes(s, stage_list, micro, remat, stage_remat) <= s.hw.memory_bytes:
      return {"remat": remat, "num_microbatches": micro, "stage_remat": stage_remat}
  return None


def island_row(s: Setup, name: str, stage_list: list[Stage]) -> dict:
  """One island's cells, memory per device (with the configured model.remat and
  train.num_microbatches), and model and executed FLOPs per token."""
  micro, memory = s.config.train.num_microbatches, s.hw.memory_bytes
  remat = s.config.model.remat
  row = {
    "island": name,
    "stages": [(st.index, st.start, st.stop, st.first, st.last) for st in stage_list],
    **state_bytes(s, stage_list),
  }
  # Every policy at the configured microbatches, for comparison; the plan's is `remat`'s.
  stage_remat = s.config.parallel.stage_remat
  row["activation_bytes_by_remat"] = {
    policy: activation_bytes(s, stage_list, micro, policy, stage_remat)
    for policy in REMAT_BY_MEMORY
  }
  row["activation_bytes"] = row["activation_bytes_by_remat"][remat]
  # Stages that return their residuals keep every intermediate autodiff saves, more than
  # layer_activation_bytes counts: the figure is a lower bound (arithmetic.py: "none").
  forwards = s.plan.num_stages > 1 and any(not st.last for st in stage_list)
  row["residuals_lower_bound"] = (
    forwards and stage_remat == "none" and keeps_every_intermediate(s.config.model, remat)
  )
  row["gathered_bytes"] = gathered(s, stage_list)
  held = row["state_bytes"] + row["gathered_bytes"]  # whatever the remat and microbatches
  row["bytes"] = held + row["activation_bytes"]
  row["fits"] = None if memory is None else row["bytes"] <= memory
  row["to_fit"] = None if row["fits"] is not False else to_fit(s, stage_list, held)
  row["flops_per_token"] = island_flops_per_token(s, stage_list)
  row["executed_flops_per_token"] = island_executed_flops_per_token(s, stage_list)
  return row


# -- compute -------------------------------------------------------------------------------------


def island_flops_per_token(s: Setup, stage_list: list[Stage]) -> float:
  """The model's training FLOPs per token of the island's cells (no recomputation)."""
  m, moe = s.config.model, s.config.moe
  block_flops, _, head_flops = arithmetic.layer_costs(m, moe, s.config.data.seq_len)
  return sum(
    sum(block_flops[st.start : st.stop]) + (head_flops if st.last else 0.0) for st in stage_list
  )


def island_executed_flops_per_token(s: Setup, stage_list: list[Stage]) -> float:
  """The FLOPs per token the island's hardware executes: the model's, plus what model.remat
  recomputes in every block's backward, plus (every pipeline stage but the last) the stage's
  forward recomputed in its B piece (zero_bubble's W takes B's residuals and recomputes
  nothing). The head is never rematerialised."""
  m, moe, seq_len = s.config.model, s.config.moe, s.config.data.seq_len
  remat = m.remat
  block_flops, _, head_flops = arithmetic.layer_costs(m, moe, seq_len)
  total = 0.0
  for st in stage_list:
    blocks = sum(block_flops[st.start : st.stop])
    total += blocks + (head_flops if st.last else 0.0)
    total += sum(
      arithmetic.remat_recompute_flops(m, moe, seq_len, remat, layer)
      for layer in range(st.start, st.stop)
    )
    if s.stages_recompute and not st.last:
      total += PIPELINE_RECOMPUTE * blocks
  return total


def compute_seconds(s: Setup, rows: list[dict]) -> float | None:
  """The slowest island's executed FLOPs per step / (its devices x peak x hardware.efficiency),
  times the pipeline bubble (None: no peak known)."""
  if not s.hw.peak_flops:
    return None
  train = s.config.train
  tokens_per_pod = train.global_batch * s.config.data.seq_len // s.plan.num_pods
  rate = s.devices_per_island * s.hw.peak_flops * s.hw.efficiency
  island_s = [r["executed_flops_per_token"] * tokens_per_pod / rate for r in rows]
  return max(island_s) * s.bubble


# -- collectives inside an island ----------------------------------------------------------------


def collectives(s: Setup, rows: list[dict]) -> dict:
  """In-island collective bytes per device and step, and their time at the ICI bandwidth.

  Per microbatch, FSDP all-gathers of the parameters in each pass (forward, backward, and a
  recomputed forward when remat "full" or "outputs" recomputes projections, or on a pipeline
  whose stages recompute, parallel.stage_remat="full")
  and the gradient reduce-scatter; one tensor all-reduce of the block
  output per layer and pass (PaLM's parallel block sums attention and MLP before reducing); the
  data-parallel gradient all-reduce once per step.
  """
  shape, m, num_micro = s.plan.mesh_shape, s.config.model, s.config.train.num_microbatches
  # Dense parameters are replicated over data and expert (the batch is split over both).
  t, f, dp = shape["tensor"], shape["fsdp"], shape["data"] * shape["expert"]
  recomputes = m.remat in ("full", "outputs") or s.stages_recompute
  passes = 3 if recomputes else 2
  param_bytes = max(r["param_bytes"] for r in rows)
  layers = max(sum(st.num_layers for st in stages) for stages in island_stages(s.plan).values())
  allreduce = 2 * (t - 1) / t * s.tokens_per_device(num_micro) * arithmetic.layer_input_bytes(m)
  ici_bytes = (
    num_micro * (passes + 1) * (f - 1) * param_bytes
    + num_micro * layers * passes * allreduce
    + 2 * (dp - 1) / dp * param_bytes
  )
  ici_s = ici_bytes / s.hw.ici_bytes_per_s if s.hw.ici_bytes_per_s else None
  return {"ici_bytes": ici_bytes, "ici_s": ici_s}


# -- the cross-pod exchange ----------------------------------------------------------------------


def cross_pod(s: Setup, rows: list[dict], compute_s: float | None) -> dict:
  """What crosses pods per (outer) step, its transfer time and the part the step waits for:
  each host sends its devices' share to its counterpart in every other pod."""
  exchange, num_pods = s.plan.exchange, s.plan.num_pods
  stage_grads = [to_stage(s.whole, stage)["params"] for stage in s.plan.stages]
  per_host = max(r["gradient_bytes_per_pod"] for r in rows) / s.hosts_per_island
  transfer_s = exposed_s = 0.0 if num_pods == 1 else None
  if num_pods > 1 and s.hw.dcn_bytes_per_s:
    transfer_s = (num_pods - 1) * per_host / s.hw.dcn_bytes_per_s
    exposed_s = exchange.exposed_s(transfer_s, compute_s, s.config.model.num_layers)
  return {
    "mode": exchange.mode if num_pods > 1 else None,
    "compression": exchange.compression,
    # Gradients one pod sends to one other pod per (outer) step; the whole step sends
    # (pods - 1) x this per pod (= the step program's exchange_bytes).
    "bytes_per_pod_pair": sent_per_pod_pair(exchange, stage_grads),
    "bytes_per_step": exchange.bytes_per_step(stage_grads),
    "bytes_per_host_pair": per_host if num_pods > 1 else 0.0,
    "transfer_s": transfer_s,
    "exposed_s": exposed_s,
  }


# -- the whole estimate --------------------------------------------------------------------------


def estimate(config) -> dict:
  """The plan and its cost model for `config` on its configured cluster, as numbers."""
  config_lib.validate(config)
  s = setup(config)
  plan, m, train = s.plan, config.model, config.train
  rows = [island_row(s, name, stages) for name, stages in island_stages(plan).items()]
  compute_s = compute_seconds(s, rows)
  exchange = cross_pod(s, rows, compute_s)
  tensor, seq_len = plan.mesh_shape["tensor"], config.data.seq_len
  return {
    "hardware": dataclasses.asdict(s.hw),
    "num_pods": plan.num_pods,
    "num_stages": len(plan.islands) // plan.num_pods,  # pipeline stages (islands per pod)
    "num_islands": len(plan.islands),
    "devices_per_island": s.devices_per_island,
    "hosts_per_island": s.hosts_per_island,
    "num_devices": s.devices_per_island * len(plan.islands),
    "mesh_shape": dict(plan.mesh_shape),
    "vocab_size": m.vocab_size,
    "tied_output": family.of(m).tied,  # the output layer is the embedding
    "padded_vocab_size": shapes.padded_vocab_size(m.vocab_size, plan.mesh_shape["tensor"]),
    "params": sum(x.size for x in jax.tree.leaves(s.whole["params"])),
    "param_dtype": m.param_dtype,
    "islands": rows,  # pod 0's; every pod's are the same
    "layer_activation_bytes_per_token": arithmetic.layer_activation_bytes(m, tensor, seq_len),
    # What one block keeps per token under each policy (models/arithmetic.py).
    "kept_bytes_per_token": {
      policy: arithmetic.remat_kept_bytes(m, tensor, seq_len, policy) for policy in REMAT_BY_MEMORY
    },
    "tokens_per_step": train.global_batch * config.data.seq_len,
    "tokens_per_device": s.tokens_per_device(train.num_microbatches),  # per microbatch
    "num_microbatches": train.num_microbatches,
    "flops_per_token": arithmetic.flops_per_token(m, config.moe, config.data.seq_len),
    "remat": m.remat,
    "stage_remat": config.parallel.stage_remat,
    "stages_recompute": s.stages_recompute,
    # Executed / model FLOPs over all islands: what remat and pipeline stages recompute.
    "recompute_factor": sum(r["executed_flops_per_token"] for r in rows)
    / sum(r["flops_per_token"] for r in rows),
    "compute_s": compute_s,
    "schedule": config.parallel.schedule,
    "bubble": s.bubble,  # the step over its busiest stage's work
    **collectives(s, rows),
    "exchange": exchange,
    **throughput(s, compute_s, exchange["exposed_s"]),
  }


def throughput(s: Setup, compute_s: float | None, exposed_s: float | None) -> dict:
  """Step time (compute + exposed transfer), tokens per second and MFU (None: unknown): a
  prediction from hardware.efficiency, the assumed fraction of peak on the executed FLOPs."""
  if compute_s is None or exposed_s is None:
    return {"step_s": None, "tokens_per_s": None, "mfu": None}
  config = s.config
  step_s = compute_s + exposed_s
  tokens_per_s = config.train.global_batch * config.data.seq_len / step_s
  flops = arithmetic.flops_per_token(config.model, config.moe, config.data.seq_len)
  num_devices = s.devices_per_island * len(s.plan.islands)
  return {
    "step_s": step_s,
    "tokens_per_s": tokens_per_s,
    "mfu": tokens_per_s * flops / (num_devices * s.hw.peak_flops),
  }
