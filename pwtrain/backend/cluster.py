"""Islands: named groups of devices joined by a fast interconnect, one SPMD mesh each.

Devices that report a `slice_index` (TPU slices, also under Pathways' IFRT proxy) are joined by
ICI only within their slice, so an island never spans two slices: `Cluster.local` carves each
slice into the same number of islands.
"""

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from pwtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Island:
  name: str
  devices: tuple  # remote islands: local stand-ins with the worker's count, for tracing/meshes
  worker: Any = dataclasses.field(default=None, compare=False, repr=False)  # remote: its client

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  @property
  def processes(self) -> frozenset:
    """The indices of the processes whose devices make up this island (distributed mode: one,
    or several for an island that spans processes; otherwise this process's)."""
    return frozenset(d.process_index for d in self.devices)

  def mesh(self, shape: dict[str, int]) -> Mesh:
    """An SPMD mesh over this island's devices with the given named axis sizes."""
    sizes = tuple(shape.values())
    if int(np.prod(sizes)) != self.num_devices:
      raise ConfigError(
        f"mesh {dict(shape)} has {int(np.prod(sizes))} devices but island {self.name!r} "
        f"has {self.num_devices}"
      )
    return make_mesh(shape, self.devices)


def make_mesh(shape: dict[str, int], devices: Sequence) -> Mesh:
  """A mesh of `devices` with named axis sizes `shape`, by `jax.make_mesh`: on TPUs and GPUs it
  orders the devices to follow the physical interconnect. Axes are Auto (sharding propagates
  from the inputs and the model's constraints), not jax.make_mesh's default Explicit.

  jax.make_mesh maps each mesh axis onto whole axes of a TPU torus, so an axis whose size is no
  product of them (PaLM 540B's 12-way tensor axis on a 8x16x24 v4 pod) is refused; such a mesh
  is built with physical axes split (mesh_utils.create_device_mesh), still following the
  interconnect within each."""
  axis_types = (AxisType.Auto,) * len(shape)
  try:
    return jax.make_mesh(
      tuple(shape.values()), tuple(shape), axis_types=axis_types, devices=list(devices)
    )
  except NotImplementedError:
    grid = mesh_utils.create_device_mesh(
      tuple(shape.values()), list(devices), allow_split_physical_axes=True
    )
    return Mesh(grid, tuple(shape), axis_types=axis_types)


def slices(devices: Sequence) -> list[list]:
  """`devices` grouped by `slice_index`, in order of first appearance; devices without one
  (CPU, GPU) form one group."""
  groups: dict = collections.defaultdict(list)
  for device in devices:
    groups[getattr(device, "slice_index", None)].append(device)
  return list(groups.values())


def _carve_slices(groups: list[list], sizes: list[int]) -> tuple[Island, ...]:
  """Equal islands, the same number from each slice, in slice order: island i lies in slice
  i // (islands per slice)."""
  size, per_slice = sizes[0], len(sizes) // len(groups)
  slice_sizes = sorted({len(g) for g in groups})
  if (
    len(set(sizes)) > 1
    or len(sizes) % len(groups)
    or len(slice_sizes) > 1
    or per_slice * size > slice_sizes[0]
  ):
    raise ConfigError(
      f"parallel.islands={len(sizes)} of {size} devices cannot be placed on {len(groups)} "
      f"slices of {slice_sizes} devices: an island must lie within one slice, so use a "
      f"multiple of {len(groups)} islands, each at most a slice (e.g. parallel.islands="
      f"{len(groups)})"
    )
  return tuple(
    Island(f"island{k * per_slice + i}", tuple(group[i * size : (i + 1) * size]))
    for k, group in enumerate(groups)
    for i in range(per_slice)
  )


@dataclasses.dataclass(frozen=True)
class Cluster:
  islands: tuple[Island, ...]

  @classmethod
  def local(cls, islands: int | Sequence[int] = 1, devices=None) -> "Cluster":
    """Carves local devices into islands (embedded mode).

    `islands` is a count (devices split evenly) or a list of island sizes, e.g. [4, 4].
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(islands, int):
      if islands < 1 or len(devices) % islands:
        raise ConfigError(
          f"parallel.islands={islands} must be >= 1 and divide the {len(devices)} local devices"
        )
      sizes = [len(devices) // islands] * islands
    else:
      sizes = list(islands)
    if sum(sizes) > len(devices) or min(sizes, default=0) < 1:
      raise ConfigError(f"islands of sizes {sizes} do not fit {len(devices)} local devices")
    groups = slices(devices)
    if len(groups) > 1:
      return cls(_carve_slices(groups, sizes))
    out, start = [], 0
    for i, size in enumerate(sizes):
      out.append(Island(f"island{i}", tuple(devices[start : start + size])))
      start += size
    return cls(tuple(out))

  @classmethod
  def connect(
    cls,
    addresses: Sequence[str],
    token: str,
    devices=None,
    timeout_s=30.0,
    heartbeat_s=2.0,
    progress_timeout_s: float = 0.0,
    tls_ca: str = "",
    isolate_losses: bool = False,
  ) -> "Cluster":
    """Attaches island workers (remote mode), one island each, named as the workers say; over
    TLS verified against the PEM file `tls_ca` when given (backend/remote/channel.py).
    `isolate_losses` (elastic pods): a lost worker loses its island only, not the cluster;
    `progress_timeout_s`: one op running longer on a worker loses it (0: never; both:
    backend/remote/client.py's Monitor).

    Pieces are still traced on this process's devices (as many as the largest island has),
    which stand in for the worker's devices: only the mesh's shape travels.
    """
    from pwtrain.backend.remote.client import Monitor, WorkerClient

    local = list(jax.devices() if devices is None else devices)
    islands = []
    for address in addresses:
      worker = WorkerClient(address, token, timeout_s=timeout_s, tls_ca=tls_ca)
      if worker.num_devices > len(local):
        raise ConfigError(
          f"worker {address} has {worker.num_devices} devices; the controller needs as many "
          f"local stand-in devices to trace for it and has {len(local)} (on CPU, set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={worker.num_devices})"
        )
      islands.append(Island(worker.island, tuple(local[: worker.num_devices]), worker))
    names = [i.name for i in islands]
    if len(set(names)) != len(names):
      raise ConfigError(f"workers {list(addresses)} serve islands {names}: names must be unique")
    monitor = Monitor(
      [i.worker for i in islands],
      heartbeat_s,
      isolate=isolate_losses,
      progress_timeout_s=progress_timeout_s,
    )
    for island in islands:
      island.worker.monitor = monitor
    return cls(tuple(islands))

  def close(self) -> None:
    """Disconnects from remote workers (embedded islands hold nothing to close)."""
    for island in self.islands:
      if island.worker is not None:
        island.worker.close()

  @property
  def remote(self) -> bool:
    return any(island.worker is not None for island in self.islands)

  def __getitem__(self, name: str) -> Island:
    for island in self.islands:
      if island.name == name:
        return island
    raise KeyError(f"no island {name!r}; have {[i.name for i in self.islands]}")

  def __len__(self) -> int:
    return len(self.islands)
