"""Islands: named groups of devices joined by a fast interconnect, one SPMD mesh each."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Island:
  name: str
  devices: tuple  # remote islands: local stand-ins with the worker's count, for tracing/meshes
  worker: Any = dataclasses.field(default=None, compare=False, repr=False)  # remote: its client

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  def mesh(self, shape: dict[str, int]) -> Mesh:
    """An SPMD mesh over this island's devices with the given named axis sizes."""
    sizes = tuple(shape.values())
    if int(np.prod(sizes)) != self.num_devices:
      raise ValueError(
        f"mesh {dict(shape)} has {int(np.prod(sizes))} devices but island {self.name!r} "
        f"has {self.num_devices}"
      )
    return Mesh(np.asarray(self.devices, dtype=object).reshape(sizes), tuple(shape))


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
        raise ValueError(
          f"parallel.islands={islands} must be >= 1 and divide the {len(devices)} local devices"
        )
      sizes = [len(devices) // islands] * islands
    else:
      sizes = list(islands)
    if sum(sizes) > len(devices) or min(sizes, default=0) < 1:
      raise ValueError(f"islands of sizes {sizes} do not fit {len(devices)} local devices")
    out, start = [], 0
    for i, size in enumerate(sizes):
      out.append(Island(f"island{i}", tuple(devices[start : start + size])))
      start += size
    return cls(tuple(out))

  @classmethod
  def connect(
    cls, addresses: Sequence[str], token: str, devices=None, timeout_s=30.0, heartbeat_s=2.0
  ) -> "Cluster":
    """Attaches island workers (remote mode), one island each, named as the workers say.

    Pieces are still traced on this process's devices (as many as the largest island has),
    which stand in for the worker's devices: only the mesh's shape travels.
    """
    from pwtrain.backend.remote.client import Monitor, WorkerClient

    local = list(jax.devices() if devices is None else devices)
    islands = []
    for address in addresses:
      worker = WorkerClient(address, token, timeout_s=timeout_s)
      if worker.num_devices > len(local):
        raise ValueError(
          f"worker {address} has {worker.num_devices} devices; the controller needs as many "
          f"local stand-in devices to trace for it and has {len(local)} (on CPU, set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={worker.num_devices})"
        )
      islands.append(Island(worker.island, tuple(local[: worker.num_devices]), worker))
    names = [i.name for i in islands]
    if len(set(names)) != len(names):
      raise ValueError(f"workers {list(addresses)} serve islands {names}: names must be unique")
    monitor = Monitor([i.worker for i in islands], heartbeat_s)
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
