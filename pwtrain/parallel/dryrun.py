"""Dry run: the plan, memory and step time of a config on its configured cluster, with no devices.

`estimate(config)` builds the plan for `parallel.*` on virtual islands (device ids, no devices),
the train state's shapes abstractly (`jax.eval_shape`; nothing is allocated), the per-device
shard of every array from its PartitionSpec and the mesh's axis sizes, and a cost model of one
step; `report(config)` prints it. Everything is arithmetic, so PaLM 540B on 6144 TPU v4 chips
plans in a second on a laptop.

The cluster's hardware is `config.hardware` (a ConfigDict whose `name` picks a preset from
HARDWARE and whose other keys override its fields, or just a preset name); without it, the
local devices. Formulas (per device; B = bytes of the activation dtype, t = parallel.tensor,
d/H/K/g/F = d_model/num_heads/head_dim/num_kv_heads/d_ff, T = seq_len):
  activations   tokens per device and microbatch x (layers x per-layer + head), where per-layer,
                what autodiff saves for a PaLM block, is B(2d + 2HK/t + 2gK + 3F/t) (block input
                and LayerNorm output; q and the attention output; k and v; gate, up, hidden) +
                (4 + B) H/t T (softmax probabilities in float32 and their cast), and the head is
                8 V/t (float32 logits and their gradient) + B d. With per-layer remat a layer
                keeps only its input (B d) and one layer's full set is live during its backward.
  compute       the step's matmul FLOPs (stages.layer_costs; x 4/3 when the forward is
                recomputed: a pipeline stage's backward, or remat, assumed whenever the
                activations as the step saves them do not fit) / (devices x peak x
                efficiency), times the pipeline bubble (M + S - 1) / M.
  cross-pod     each pod sends its (encoded) gradients to every other pod; each host sends its
                devices' share, bytes / hosts per island, at the host's DCN bandwidth. Exposed:
                all of it (sync), the part the backward cannot hide (overlapped), what exceeds a
                step (stale), or amortised over `exchange.inner_steps` (diloco).
  step          compute + exposed transfer; MFU = tokens x plan.flops_per_token / (step x all
                devices x peak).
In-island collectives (FSDP gathers and scatters, tensor all-reduces) are estimated at the ICI
bandwidth and assumed hidden under compute; the report says when they could not be.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from pwtrain import config as config_lib
from pwtrain import metrics, optim
from pwtrain import step as step_lib
from pwtrain.backend.cluster import Cluster, Island
from pwtrain.models import moe as moe_lib
from pwtrain.parallel import exchange, pipeline, spmd
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel.stages import layer_costs, make_stages, to_stage

# The forward is recomputed once in the backward (remat, or a pipeline stage's backward):
# forward = 1/3 of the training FLOPs, so the hardware does 4/3 of the model FLOPs.
RECOMPUTE_FACTOR = 4.0 / 3.0


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_flops: float | None  # dense bf16 FLOP/s per device (None: unknown, no time estimate)
  memory_bytes: float | None  # accelerator memory per device
  devices_per_host: int
  ici_bytes_per_s: float | None  # per device, for collectives inside an island
  dcn_bytes_per_s: float | None  # per host and direction, between islands
  efficiency: float  # fraction of peak the compute achieves on the FLOPs it executes (HFU)


HARDWARE = {
  "tpu_v4": Hardware(
    name="tpu_v4",
    # Cloud TPU v4 documentation (cloud.google.com/tpu/docs/v4): 275 TFLOP/s bf16 per chip,
    # 32 GiB HBM2 per chip.
    peak_flops=275e12,
    memory_bytes=32.0 * 2**30,
    # PaLM (Chowdhery et al., 2022, section 4): a pod's 3072 chips are attached to 768 hosts.
    devices_per_host=4,
    # Same documentation: all-reduce bandwidth 1.1 PB/s per 4096-chip pod, ~269 GB/s per chip
    # (each chip has six ICI links of 400 Gb/s = 50 GB/s per direction, 300 GB/s raw).
    ici_bytes_per_s=1.1e15 / 4096,
    # PaLM section 4: the cross-pod gradient exchange bursts at 81 Tb/s over all 1536 hosts,
    # ~52.7 Gb/s = 6.6 GB/s per host. This is what PaLM achieved, not a NIC's line rate.
    dcn_bytes_per_s=81e12 / 8 / 1536,
    # PaLM 540B's measured hardware FLOPs utilisation, 57.8% (section 4 and appendix B): the
    # efficiency of the compute, rematerialisation included (its MFU, 46.2%, is lower because
    # recomputed FLOPs are not model FLOPs).
    efficiency=0.578,
  ),
}

DEFAULT_EFFICIENCY = 0.5  # for local devices: an assumption, not a measurement


def hardware(config) -> Hardware:
  """`config.hardware` (a preset name, or a ConfigDict of `name` + overrides), else the local
  devices (peak FLOP/s from metrics.PEAK_FLOPS; none known for CPU)."""
  spec = config.get("hardware")
  if spec is None:
    device = jax.devices()[0]
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    return Hardware(
      name=device.device_kind,
      peak_flops=metrics.peak_flops(device),
      memory_bytes=stats.get("bytes_limit"),
      devices_per_host=jax.local_device_count(),
      ici_bytes_per_s=None,
      dcn_bytes_per_s=None,
      efficiency=DEFAULT_EFFICIENCY,
    )
  overrides = {"name": spec} if isinstance(spec, str) else spec.to_dict()
  name = overrides.pop("name", None)
  if name not in HARDWARE:
    raise ValueError(f"hardware.name={name!r} is not a known cluster; valid: {', '.join(HARDWARE)}")
  fields = {f.name for f in dataclasses.fields(Hardware)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"hardware.{unknown[0]} is not a hardware field; valid: {sorted(fields)}")
  return dataclasses.replace(HARDWARE[name], **overrides)


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
  """The vocabulary rounded up to a multiple of the tensor axis, as XLA pads uneven shards."""
  return -(-vocab_size // tensor) * tensor


def virtual_cluster(config) -> Cluster:
  """`parallel.islands` islands of `parallel.devices_per_island` device ids (0: the local
  device count split over the islands): what the plan needs, with no devices behind it."""
  n = config.parallel.islands
  if n < 1:
    raise ValueError(f"parallel.islands={n} must be >= 1")
  per = config.parallel.devices_per_island or jax.device_count() // n
  if per < 1:
    raise ValueError(f"parallel.devices_per_island={per} must be >= 1")
  return Cluster(
    tuple(Island(f"island{i}", tuple(range(i * per, (i + 1) * per))) for i in range(n))
  )


def build_plan(config) -> tuple[plan_lib.Plan, int]:
  """plan.build on the virtual cluster; returns (plan, padded vocab size).

  plan.build requires parallel.tensor to divide model.vocab_size, which PaLM's 256000 and
  12-way tensor parallelism do not; the planner sees the vocabulary padded to a multiple of
  the tensor axis (the padding rows are what XLA adds to the uneven shards).
  """
  cluster = virtual_cluster(config)
  mesh_shape = plan_lib.resolve_mesh_shape(config.parallel, cluster.islands[0].num_devices)
  padded = padded_vocab_size(config.model.vocab_size, mesh_shape["tensor"])
  checked = config.copy_and_resolve_references()
  checked.model.vocab_size = padded
  return plan_lib.build(checked, cluster), padded


@dataclasses.dataclass(frozen=True)
class _ShapeOnlyFns(step_lib.ModelFns):
  """ModelFns whose init returns zeros of the abstract shapes: for eval_shape only."""

  def init(self, key) -> dict:
    del key
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.abstract_params)


def model_fns(model_cfg, moe=None) -> step_lib.ModelFns:
  """The whole model's abstract params and logical axes, from a model of one period of layers.

  Blocks repeat with the MoE schedule's period (`moe.every`; 1 for a dense model), so the
  period's blocks are copied to all layers: the same trees as step.model_fns(model_cfg, moe)
  (tested), in 0.1 s instead of 20 s for PaLM 540B's 118 layers. The graphdef is the short
  model's: shapes only, not for running.
  """
  period = min(moe.every, model_cfg.num_layers) if moe_lib.enabled(moe) else 1
  one = step_lib.model_fns(model_cfg, moe, num_layers=period)

  def widen(tree):
    blocks = {i: tree["blocks"][i % period] for i in range(model_cfg.num_layers)}
    return {**tree, "blocks": blocks}

  return _ShapeOnlyFns(
    one.graphdef, widen(one.abstract_params), widen(one.logical_axes), model_cfg, moe
  )


def abstract_state(config, fns, tx) -> dict:
  """The whole-model train state as ShapeDtypeStructs, with what the exchange mode carries."""
  pods, mode = config.parallel.pods, config.exchange.mode

  def init():
    state = step_lib.init_state(fns, tx, config.seed)
    if pods > 1 and mode == "stale":
      state["pending"] = exchange.init_pending(state["params"], config.moe.num_experts)
    if pods > 1 and mode == "diloco":
      outer_tx = exchange.outer_optimizer(config.exchange)
      state["outer"] = exchange.init_outer(state["params"], outer_tx)
    return state

  return jax.eval_shape(init)


def shard_bytes(leaf, sharding, mesh_shape: dict[str, int]) -> int:
  """Bytes of one device's shard: each dim divided (rounded up) by its mesh axes' sizes."""
  n = 1
  spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
  for dim, axes in zip(leaf.shape, spec, strict=True):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    n *= -(-dim // math.prod(mesh_shape[a] for a in axes))
  return n * jnp.dtype(leaf.dtype).itemsize


def tree_bytes(tree) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _layer_activation_bytes(m, tensor: int, seq_len: int) -> float:
  """Bytes autodiff saves per token for one PaLM block (see the module docstring)."""
  b = jnp.dtype(m.dtype).itemsize
  heads = m.num_heads / tensor
  saved = 2 * m.d_model + 2 * heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim
  saved += 3 * m.d_ff / tensor
  return b * saved + (4 + b) * heads * seq_len


def _head_activation_bytes(m, tensor: int) -> float:
  return 8 * math.ceil(m.vocab_size / tensor) + jnp.dtype(m.dtype).itemsize * m.d_model


def _exposed_s(config, transfer_s: float, compute_s: float | None) -> float | None:
  """The part of the cross-pod transfer the step waits for."""
  mode = config.exchange.mode
  if mode == "sync":  # sent when the backward is done, summed before the update
    return transfer_s
  if mode == "diloco":  # one exchange every inner_steps steps
    return transfer_s / config.exchange.inner_steps
  if compute_s is None:
    return None
  if mode == "stale":  # a whole step to arrive
    return max(0.0, transfer_s - compute_s)
  # overlapped: a bucket's transfer hides under the backward of the buckets after it; the last
  # bucket's is always exposed.
  buckets = min(config.exchange.buckets, config.model.num_layers)
  backward_s = compute_s * 2 / 3
  return max(transfer_s / buckets, transfer_s - backward_s * (buckets - 1) / buckets)


def estimate(config) -> dict:
  """The plan and its cost model for `config` on its configured cluster, as numbers.

  Byte counts are per device unless named otherwise; times are seconds per step.
  """
  config_lib.validate(config)
  hw = hardware(config)
  plan, padded_vocab = build_plan(config)
  mesh_shape = dict(plan.mesh_shape)
  mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  p, m, train = config.parallel, config.model, config.train
  num_pods, num_micro, seq = p.pods, train.num_microbatches, config.data.seq_len
  # Dense parameters are replicated over data and expert (the batch is split over both).
  t, f, dp = mesh_shape["tensor"], mesh_shape["fsdp"], mesh_shape["data"] * mesh_shape["expert"]
  devices_per_island = plan.islands[0].num_devices
  hosts_per_island = math.ceil(devices_per_island / hw.devices_per_host)

  tx, _ = optim.build(config.optim, train.num_steps)
  fns = model_fns(m, config.moe)
  whole = abstract_state(config, fns, tx)
  num_params = sum(x.size for x in jax.tree.leaves(whole["params"]))

  # Cells (pod, stage) -> islands, as the step program places them; pods are identical, so pod
  # 0's islands describe every pod.
  if num_pods > 1 or p.stages > 1:
    placement = pipeline.cell_islands(config, plan)
  else:
    placement = {(0, 0): plan.islands[0]}
  num_cells = len(placement) // num_pods
  stages = make_stages(config, num_cells)
  islands = {}
  for s, stage in enumerate(stages):
    islands.setdefault(placement[(0, s)].name, []).append(stage)
  num_islands_per_pod = len(islands)
  compression = config.exchange.compression if num_pods > 1 else "none"
  exchanges = num_pods > 1

  tokens_per_step = train.global_batch * seq
  tokens_per_device = train.global_batch // num_pods // num_micro // plan.batch_shards * seq
  layer_act = _layer_activation_bytes(m, t, seq)
  block_flops, _, head_flops = layer_costs(config)
  act_bytes = jnp.dtype(m.dtype).itemsize

  def activations(stage_list, micro: int, remat: bool) -> float:
    """Activation bytes per device of one island's stages at `micro` microbatches."""
    tokens = train.global_batch // num_pods // micro // plan.batch_shards * seq
    live, working, kept = 0.0, 0.0, 0.0
    for stage in stage_list:
      if not stage.last and num_cells > 1:
        # Stage inputs (int32 tokens on the first stage) saved for the stage's backward.
        order = pipeline.island_order(p.schedule, stage, num_cells, micro)
        live += pipeline.peak_live_inputs(order) * (4 if stage.first else act_bytes * m.d_model)
      head = _head_activation_bytes(m, t) if stage.last else 0.0
      if remat:
        kept += stage.num_layers * act_bytes * m.d_model
        working = max(working, layer_act + head)
      else:
        working = max(working, stage.num_layers * layer_act + head)
    return tokens * (live + kept + working)

  island_rows, grads_encoded_total = [], 0
  for name, stage_list in islands.items():
    row = {
      "island": name,
      "stages": [(s.index, s.start, s.stop, s.first, s.last) for s in stage_list],
      "params": 0,
      "param_bytes": 0,
      "optimizer_bytes": 0,
      "exchange_state_bytes": 0,
      "other_state_bytes": 0,
      "exchange_buffer_bytes": 0,
      "gradient_bytes_per_pod": 0,
    }
    for stage in stage_list:
      state = to_stage(whole, stage)
      stage_fns = dataclasses.replace(fns, logical_axes=to_stage(fns.logical_axes, stage))
      shardings = spmd.state_shardings(stage_fns, mesh, state)
      per_device = jax.tree.map(lambda a, s: shard_bytes(a, s, mesh_shape), state, shardings)
      grads = state["params"]
      encoded = exchange.encoded_bytes(grads, compression)
      row["params"] += sum(x.size for x in jax.tree.leaves(grads))
      row["param_bytes"] += sum(jax.tree.leaves(per_device["params"]))
      row["optimizer_bytes"] += sum(jax.tree.leaves(per_device["opt_state"]))
      for key in ("pending", "outer"):
        row["exchange_state_bytes"] += sum(jax.tree.leaves(per_device.get(key, {})))
      for key in ("step", "rng"):
        row["other_state_bytes"] += sum(jax.tree.leaves(per_device[key]))
      if exchanges:
        # As pipeline.build counts it: each stage's gradients (both copies of the shared
        # embedding under pipelining), encoded.
        row["gradient_bytes_per_pod"] += encoded
        grads_encoded_total += encoded
        # Received pods' encoded gradients (and this pod's own when it is encoded), per device.
        ratio = encoded / tree_bytes(grads)
        copies = num_pods if compression != "none" else num_pods - 1
        if config.exchange.mode != "diloco":
          row["exchange_buffer_bytes"] += round(
            copies * ratio * sum(jax.tree.leaves(per_device["params"]))
          )
    row["gradient_buffer_bytes"] = row["param_bytes"]  # running sums, in the params' dtype
    row["state_bytes"] = (
      row["param_bytes"]
      + row["optimizer_bytes"]
      + row["exchange_state_bytes"]
      + row["other_state_bytes"]
      + row["gradient_buffer_bytes"]
      + row["exchange_buffer_bytes"]
    )
    row["activation_bytes"] = activations(stage_list, num_micro, remat=False)
    row["activation_bytes_remat"] = activations(stage_list, num_micro, remat=True)
    row["bytes"] = row["state_bytes"] + row["activation_bytes"]
    row["bytes_remat"] = row["state_bytes"] + row["activation_bytes_remat"]
    row["fits"] = None if hw.memory_bytes is None else row["bytes"] <= hw.memory_bytes
    row["fits_remat"] = None if hw.memory_bytes is None else row["bytes_remat"] <= hw.memory_bytes
    # Smallest train.num_microbatches that would fit with remat (None: none does, or unknown).
    row["microbatches_to_fit_remat"] = None
    if hw.memory_bytes is not None:
      per_pod = train.global_batch // num_pods // plan.batch_shards
      for micro in range(1, per_pod + 1):
        if per_pod % micro == 0:
          bytes_ = row["state_bytes"] + activations(stage_list, micro, remat=True)
          if bytes_ <= hw.memory_bytes:
            row["microbatches_to_fit_remat"] = micro
            break
    row["flops_per_token"] = sum(
      sum(block_flops[s.start : s.stop]) + (head_flops if s.last else 0.0) for s in stage_list
    )
    island_rows.append(row)

  # Remat is assumed when the step as written (all activations saved) does not fit.
  remat = any(r["fits"] is False for r in island_rows)
  recompute = RECOMPUTE_FACTOR if (remat or num_cells > 1) else 1.0
  tokens_per_pod = tokens_per_step // num_pods
  compute_s = None
  if hw.peak_flops:
    rate = devices_per_island * hw.peak_flops * hw.efficiency
    island_s = [r["flops_per_token"] * tokens_per_pod * recompute / rate for r in island_rows]
    bubble = (num_micro + num_islands_per_pod - 1) / num_micro
    compute_s = max(island_s) * bubble

  # In-island collectives, per device and step (assumed overlapped with compute): FSDP
  # all-gathers of the parameters in each pass (forward, backward, recomputed forward) and the
  # gradient reduce-scatter, per microbatch; one tensor all-reduce of the block output per layer
  # and pass (PaLM's parallel block sums attention and MLP before reducing); the data-parallel
  # gradient all-reduce once per step.
  passes = 3 if remat else 2
  param_bytes = max(r["param_bytes"] for r in island_rows)
  layers = max(sum(s.num_layers for s in sl) for sl in islands.values())
  allreduce = 2 * (t - 1) / t * tokens_per_device * m.d_model * act_bytes
  ici_bytes = (
    num_micro * (passes + 1) * (f - 1) * param_bytes
    + num_micro * layers * passes * allreduce
    + 2 * (dp - 1) / dp * param_bytes
  )
  ici_s = ici_bytes / hw.ici_bytes_per_s if hw.ici_bytes_per_s else None

  # Cross-pod exchange: each host sends its devices' share to its counterpart in every other pod.
  per_host = max(r["gradient_bytes_per_pod"] for r in island_rows) / hosts_per_island
  transfer_s = exposed_s = 0.0 if not exchanges else None
  if exchanges and hw.dcn_bytes_per_s:
    transfer_s = (num_pods - 1) * per_host / hw.dcn_bytes_per_s
    exposed_s = _exposed_s(config, transfer_s, compute_s)

  flops_per_token = plan_lib.flops_per_token(config)
  num_devices = devices_per_island * len(plan.islands)
  step_s = mfu = tokens_per_s = None
  if compute_s is not None and exposed_s is not None:
    step_s = compute_s + exposed_s
    tokens_per_s = tokens_per_step / step_s
    mfu = tokens_per_s * flops_per_token / (num_devices * hw.peak_flops)

  return {
    "hardware": dataclasses.asdict(hw),
    "num_pods": num_pods,
    "num_stages": p.stages,
    "num_islands": len(plan.islands),
    "devices_per_island": devices_per_island,
    "hosts_per_island": hosts_per_island,
    "num_devices": num_devices,
    "mesh_shape": mesh_shape,
    "vocab_size": m.vocab_size,
    "padded_vocab_size": padded_vocab,
    "params": num_params,
    "param_dtype": m.param_dtype,
    "islands": island_rows,  # pod 0's; every pod's are the same
    "layer_activation_bytes_per_token": layer_act,
    "tokens_per_step": tokens_per_step,
    "tokens_per_device": tokens_per_device,  # per microbatch
    "num_microbatches": num_micro,
    "flops_per_token": flops_per_token,
    "remat": remat,
    "recompute_factor": recompute,
    "compute_s": compute_s,
    "ici_bytes": ici_bytes,
    "ici_s": ici_s,
    "exchange": {
      "mode": config.exchange.mode if exchanges else None,
      "compression": compression,
      # Gradients one pod sends to one other pod per (outer) step; the whole step sends
      # (pods - 1) x this per pod (= the step program's exchange_bytes).
      "bytes_per_pod_pair": grads_encoded_total,
      "bytes_per_step": (num_pods - 1) * grads_encoded_total,
      "bytes_per_host_pair": per_host if exchanges else 0.0,
      "transfer_s": transfer_s,
      "exposed_s": exposed_s,
    },
    "step_s": step_s,
    "tokens_per_s": tokens_per_s,
    "mfu": mfu,
  }


def _size(n: float) -> str:
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _seconds(x) -> str:
  return "n/a" if x is None else f"{x:.3g} s"


def _fits(value) -> str:
  return {None: "capacity unknown", True: "fits", False: "does NOT fit"}[value]


def report(config) -> str:
  """`estimate(config)` as printable lines (sizes in decimal units: 1 GB = 1e9 bytes)."""
  e = estimate(config)
  hw, x = e["hardware"], e["exchange"]
  # The expert axis is shown only where it splits something (an MoE model's experts).
  axes = {a: n for a, n in e["mesh_shape"].items() if a != "expert" or n > 1}
  mesh = " x ".join(f"{a}={n}" for a, n in axes.items())
  count = f"{e['params'] / 1e9:,.2f}B" if e["params"] >= 1e9 else f"{e['params'] / 1e6:,.2f}M"
  lines = [
    f"Dry run: {count} parameters ({e['params']:,}, {e['param_dtype']}), "
    f"{e['num_pods']} pod(s) x {e['num_stages']} stage(s) = {e['num_islands']} island(s) of "
    f"{e['devices_per_island']} {hw['name']} devices ({e['num_devices']} devices, "
    f"{e['hosts_per_island']} host(s) per island)",
    f"Mesh per island: {mesh}",
  ]
  if e["padded_vocab_size"] != e["vocab_size"]:
    lines.append(
      f"Vocabulary: {e['vocab_size']:,} padded to {e['padded_vocab_size']:,} for "
      f"tensor={e['mesh_shape']['tensor']} sharding"
    )
  memory = hw["memory_bytes"]
  capacity = "unknown" if memory is None else f"{_size(memory)} ({memory / 2**30:.3g} GiB)"
  for r in e["islands"]:
    parts = []
    kind = "stage" if len(r["stages"]) == 1 or e["num_stages"] > 1 else "chunk"
    for index, start, stop, first, last in r["stages"]:
      part = f"{kind} {index}: layers {start}-{stop - 1}"
      part += " + embedding" if first else ""
      part += " + head" if last and not first else (" + head (tied)" if last else "")
      parts.append(part)
    lines += [
      f"{r['island']} ({'; '.join(parts)}; every pod alike), per device:",
      f"  parameters       {_size(r['param_bytes'])} ({r['params'] / 1e9:,.3f}B params)",
      f"  optimizer state  {_size(r['optimizer_bytes'])}",
      f"  gradients        {_size(r['gradient_buffer_bytes'])} (running sums)",
    ]
    if r["exchange_state_bytes"]:
      lines.append(f"  exchange state   {_size(r['exchange_state_bytes'])}")
    if r["exchange_buffer_bytes"]:
      lines.append(f"  exchange buffers {_size(r['exchange_buffer_bytes'])} (pods' gradients)")
    lines += [
      f"  activations      {_size(r['activation_bytes'])} as the step runs (all saved), "
      f"{_size(r['activation_bytes_remat'])} with per-layer remat",
      f"  total            {_size(r['bytes'])} ({_fits(r['fits'])}), "
      f"{_size(r['bytes_remat'])} with remat ({_fits(r['fits_remat'])}) in {capacity}",
    ]
    micro = r["microbatches_to_fit_remat"]
    if r["fits_remat"] is False:
      lines.append(
        "  to fit           remat and "
        + (f"train.num_microbatches={micro}" if micro else "more devices (no microbatching fits)")
      )
  if e["compute_s"] is None:
    compute = f"Compute: n/a (no peak FLOP/s known for {hw['name']})"
  else:
    compute = (
      f"Compute: {e['compute_s']:.3g} s per step at {hw['efficiency']:.1%} of "
      f"{hw['peak_flops'] / 1e12:g} TFLOP/s per device"
    )
    if e["recompute_factor"] != 1:
      compute += f", x{e['recompute_factor']:.3g} for recomputing the forward"
  lines += [
    f"Activations per token and layer: {_size(e['layer_activation_bytes_per_token'])}; "
    f"tokens per device and microbatch: {e['tokens_per_device']:,}",
    f"FLOPs per token: {e['flops_per_token']:.4g} (6N + 12LHQT); tokens per step: "
    f"{e['tokens_per_step']:,} ({config.train.global_batch} x {config.data.seq_len})",
    compute,
    f"In-island collectives: {_size(e['ici_bytes'])} per device per step, "
    f"{_seconds(e['ici_s'])} at ICI bandwidth (assumed hidden under compute"
    + (": NOT hideable)" if e["ici_s"] and e["compute_s"] and e["ici_s"] > e["compute_s"] else ")"),
  ]
  if x["mode"] is None:
    lines.append("Cross-pod exchange: none (one pod)")
  else:
    dcn = hw["dcn_bytes_per_s"]
    lines += [
      f"Cross-pod exchange ({x['mode']}, compression {x['compression']}): "
      f"{_size(x['bytes_per_pod_pair'])} per pod pair per step, "
      f"{_size(x['bytes_per_host_pair'])} per host pair",
      f"  transfer {_seconds(x['transfer_s'])} at "
      f"{'n/a' if dcn is None else _size(dcn) + '/s'} per host; exposed {_seconds(x['exposed_s'])}",
    ]
  if e["step_s"] is None:
    lines.append("Step: n/a (no peak FLOP/s or network bandwidth known for this hardware)")
  else:
    lines.append(
      f"Step: {e['step_s']:.3g} s; MFU {e['mfu']:.1%}; {e['tokens_per_s']:,.0f} tokens/s"
    )
  return "\n".join(lines)
