"""The cluster's hardware: per-device FLOP/s, memory and bandwidths the dry run costs a plan on.

`hardware(config)` reads `config.hardware`: a preset name from HARDWARE, or a ConfigDict whose
`name` picks the preset and whose other keys override its fields. Without it, the local devices
(peak FLOP/s from metrics.peak_flops, memory from the device's stats; no bandwidths known).
"""

import dataclasses

import jax

from pwtrain import metrics
from pwtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_flops: float | None  # dense bf16 FLOP/s per device (None: unknown, no time estimate)
  memory_bytes: float | None  # accelerator memory per device
  devices_per_host: int
  ici_bytes_per_s: float | None  # per device, for collectives inside an island
  dcn_bytes_per_s: float | None  # per host and direction, between islands
  # The fraction of peak_flops the step's compute is assumed to reach on the FLOPs it executes
  # (recomputed ones included: a hardware FLOPs utilisation). An input to the estimate, never a
  # result: the step time and MFU the dry run predicts follow from it.
  efficiency: float
  # The TPU topology of one slice (one pod), e.g. "v4:8x16x24", that `--dry_run --compile`
  # compiles the step for (dryrun/compile.py); None: not given (the dry run's arithmetic does
  # not need it).
  topology: str | None = None


# See the tpu_v4 preset: the fraction of peak a well-tuned large step is assumed to reach.
ASSUMED_EFFICIENCY = 0.5

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
    # ASSUMED, not measured on TPU v4: a large, well-tuned, matmul-bound training step
    # executes at about half its chip's peak FLOP/s. The round number rests on the published
    # utilisation of large dense transformer training on another system: Megatron-LM trains a
    # 1T-parameter GPT at 52% of A100 peak per GPU, its FLOPs counting the recomputed forward
    # (Narayanan et al., 2021, arXiv:2104.04473). Matmuls alone run nearer peak; the step's
    # norms, softmax, elementwise work and collectives not fully hidden pull it down. It is
    # deliberately NOT PaLM's measured 57.8% hardware FLOPs utilisation: that is the figure
    # the dry run's predictions are compared against, never an input to them.
    efficiency=ASSUMED_EFFICIENCY,
  ),
  "h100": Hardware(
    name="h100",
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1979 with sparsity), 80 GB HBM3;
    # DGX H100: 8 GPUs per host, NVLink 4 at 900 GB/s per GPU (450 per direction), and one
    # 400 Gb/s InfiniBand port per GPU (8 x 50 GB/s per host and direction).
    peak_flops=989e12,
    memory_bytes=80e9,
    devices_per_host=8,
    ici_bytes_per_s=450e9,
    dcn_bytes_per_s=8 * 50e9,
    efficiency=ASSUMED_EFFICIENCY,  # the same assumption as tpu_v4's, not a measurement
  ),
}

DEFAULT_EFFICIENCY = ASSUMED_EFFICIENCY  # for local devices: the same assumption


def hardware(config) -> Hardware:
  """`config.hardware` (a preset name, or a ConfigDict of `name` + overrides), else the local
  devices."""
  spec = config.get("hardware")
  if spec is None:
    return local_hardware()
  overrides = {"name": spec} if isinstance(spec, str) else spec.to_dict()
  name = overrides.pop("name", None)
  if name not in HARDWARE:
    raise ConfigError(
      f"hardware.name={name!r} is not a known cluster; valid: {', '.join(HARDWARE)}"
    )
  fields = {f.name for f in dataclasses.fields(Hardware)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ConfigError(f"hardware.{unknown[0]} is not a hardware field; valid: {sorted(fields)}")
  return dataclasses.replace(HARDWARE[name], **overrides)


def slice_devices(topology: str) -> int:
  """Devices in one slice of the TPU topology "<generation>:<A>x<B>[x<C>]": its chips (one JAX
  device per chip; dryrun/compile.py compiles v4 and v5p in megacore mode)."""
  try:
    dims = [int(d) for d in topology.split(":", 1)[1].split("x")]
  except (IndexError, ValueError):
    dims = []
  if not dims or min(dims) < 1:
    raise ConfigError(
      f"hardware.topology={topology!r} is not a TPU topology; valid: '<generation>:<A>x<B>x<C>', "
      "e.g. 'v4:4x4x4' or 'v5e:4x4'"
    )
  n = 1
  for d in dims:
    n *= d
  return n


def cluster_devices(config) -> int:
  """The devices the dry run plans for: hardware.topology's, one slice per pod, when given;
  else the local devices."""
  topology = hardware(config).topology
  if topology is None:
    return jax.device_count()
  return slice_devices(topology) * config.parallel.pods


def local_hardware() -> Hardware:
  """The local devices: peak FLOP/s from metrics.peak_flops (none known for CPU), memory from
  the first device's stats, no bandwidths, DEFAULT_EFFICIENCY."""
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
