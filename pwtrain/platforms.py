"""Which platform a command runs on: whatever JAX can initialise, never a guess.

Every command (`pwtrain.main`, `sample`, `launch`'s processes, `convert`, `serve`, the remote
island worker) calls `prepare()` first, before JAX starts a backend:

- The CPU is given `SIMULATED_CPU_DEVICES` devices (XLA's
  `--xla_force_host_platform_device_count`, added to XLA_FLAGS unless they set a count), so that
  islands, meshes and pipelines have devices to use on a host without an accelerator. An
  accelerator's backend ignores the flag.
- XLA:CPU computes each operation one way in every program (`CPU_NUMERICS_FLAG`, added to
  XLA_FLAGS unless they name that flag): XLA:CPU (jaxlib 0.10.2) hands a reduction to YNNPACK
  together with the elementwise operations XLA fuses around it, and YNNPACK's rsqrt and
  exp round differently from XLA's own in about a third of their float32 inputs (by one unit in
  the last place). Which operations join a reduction's fusion depends on the program: a
  LayerNorm's rsqrt sits inside the norm's fusion in a forward pass, but outside it in a
  gradient program, whose backward pass reads it. So the same model gave other float32 logits
  in a training step than in a forward pass of the same weights (up to 1.3e-5 at logits of 9.8
  in docs/rl.md's toy policy); with reductions left to XLA's emitters they are bitwise equal
  (docs/rl.md, "How far the sampler's and the trainer's log-probs are apart"). An accelerator's
  backend ignores the flag.
- JAX_PLATFORMS, when set, is the user's choice and is left alone.
- Otherwise JAX initialises every backend it can, as it always does: a GPU wherever its plugin
  finds one (WSL2, Jetson and every other host included), a TPU, any other PJRT plugin. The one
  backend kept from trying is the TPU's on a host where JAX's own check finds no TPU chip (the
  PCI scan that `jax._src.cloud_tpu_init` itself runs, `tpu_chips()`): libtpu, installed with the
  `[tpu]` extra for `--dry_run --compile`, would only fail there, after printing a page of
  errors. Compiling for a TPU topology (`jax.experimental.topologies`) loads libtpu by itself and
  is unaffected.

`describe()`, once JAX has started, is the line each command begins with: the platform and the
device count, with "simulated" where the devices are the CPU's simulated ones.
"""

import glob
import importlib.metadata
import logging
import os
import re

log = logging.getLogger(__name__)

SIMULATED_CPU_DEVICES = 8
_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's reductions (and the elementwise operations fused with them) by XLA's own emitters,
# not YNNPACK's (module doc). Given only to the jaxlib releases where it was checked (0.10.2 and
# later 0.10.x): an XLA that does not know a flag stops the process, and an experimental flag
# may go; a later jaxlib gets it once checked again (tests/test_platforms.py fails until then).
CPU_NUMERICS_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-reduce"
_CPU_NUMERICS_SINCE = (0, 10, 2)
_CPU_NUMERICS_BEFORE = (0, 11, 0)
_GOOGLE_PCI_VENDOR = "0x1ae0"  # what JAX's hardware_utils looks for; its device ids name TPUs


def prepare(cpu_devices: int | None = None) -> None:
  """Before JAX starts: simulated CPU devices (`cpu_devices`, default SIMULATED_CPU_DEVICES,
  unless XLA_FLAGS already sets a count; a given `cpu_devices` replaces it), and the TPU backend
  kept from trying where no TPU chip is attached (see the module doc)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if cpu_devices is not None:
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", flags)
  if _COUNT_FLAG not in flags:
    count = cpu_devices or SIMULATED_CPU_DEVICES
    flags = f"{flags} {_COUNT_FLAG}={count}"
  os.environ["XLA_FLAGS"] = with_cpu_numerics(flags)
  if skip_tpu(os.environ, libtpu_installed(), tpu_chips()):
    _unregister_tpu()


def with_cpu_numerics(flags: str, jaxlib_version: str | None = None) -> str:
  """XLA_FLAGS `flags` with `CPU_NUMERICS_FLAG` added (module doc), unless they name that flag
  already (the user's choice) or jaxlib (installed, or `jaxlib_version`) is not one it was
  checked with."""
  flag, flags = CPU_NUMERICS_FLAG.split("=")[0], " ".join(flags.split())
  if jaxlib_version is None:
    try:
      jaxlib_version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
      return flags
  release = tuple(int(x) for x in re.findall(r"\d+", jaxlib_version)[:3])
  if flag in flags or not _CPU_NUMERICS_SINCE <= release < _CPU_NUMERICS_BEFORE:
    return flags
  return f"{flags} {CPU_NUMERICS_FLAG}".strip()


def skip_tpu(environ, libtpu: bool, chips: int) -> bool:
  """Whether JAX's TPU backend is kept from trying: libtpu is installed, no TPU chip is
  attached, the user named no platforms (JAX_PLATFORMS) and did not force TPU initialisation
  (JAX_FORCE_TPU_INIT, as JAX reads it)."""
  if environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in environ:
    return False
  return libtpu and chips == 0


def libtpu_installed() -> bool:
  import importlib.util

  return importlib.util.find_spec("libtpu") is not None


def tpu_chips() -> int:
  """TPU chips attached to this host, by JAX's own check (jax._src.hardware_utils); where that
  module is missing, by the same PCI scan (Google's vendor id, a TPU device id)."""
  try:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]
  except (ImportError, AttributeError):
    count = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
      with open(vendor) as f:
        count += f.read().strip() == _GOOGLE_PCI_VENDOR
    return count


def _unregister_tpu() -> None:
  """Replaces the TPU backend's factory in JAX's registry (jax._src.xla_bridge; nothing has
  started yet) with one that fails at once, without loading libtpu, as JAX's own fails on such a
  host after its errors: the TPU stays a platform JAX knows (lowering rules name it), and JAX
  goes on to the other backends as it does after any TPU failure. Should JAX move that registry,
  the backend stays, and libtpu's errors are printed as before: nothing else changes."""
  import dataclasses

  from jax._src import xla_bridge

  factories = getattr(xla_bridge, "_backend_factories", None)
  if not isinstance(factories, dict) or "tpu" not in factories:
    return
  if xla_bridge.backends_are_initialized():
    return
  factories["tpu"] = dataclasses.replace(factories["tpu"], factory=_no_tpu_chip)


def _no_tpu_chip():
  raise RuntimeError("no TPU chip is attached to this host (pwtrain.platforms)")


def describe() -> str:
  """`platform: <name>, <n> devices (<kind>)` for the devices JAX started with, e.g.
  `platform: cpu, 8 devices (simulated on the CPU: no accelerator was found; JAX_PLATFORMS names
  one to insist)`; in a run of several processes, also how many processes share them."""
  import jax

  devices = jax.devices()
  platform = devices[0].platform
  count = f"{len(devices)} device{'s' if len(devices) != 1 else ''}"
  if jax.process_count() > 1:
    count += f" in {jax.process_count()} processes"
  if platform == "cpu":
    if os.environ.get("JAX_PLATFORMS"):
      why = f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}"
    else:
      why = "no accelerator was found; JAX_PLATFORMS=gpu or tpu insists on one"
    kind = f"simulated on the CPU: {why}" if jax.local_device_count() > 1 else f"the CPU: {why}"
  else:
    kind = devices[0].device_kind
  return f"platform: {platform}, {count} ({kind})"
