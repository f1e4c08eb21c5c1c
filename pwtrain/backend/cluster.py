"""Islands: named groups of devices joined by a fast interconnect, one SPMD mesh each."""

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Island:
  name: str
  devices: tuple

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

  def __getitem__(self, name: str) -> Island:
    for island in self.islands:
      if island.name == name:
        return island
    raise KeyError(f"no island {name!r}; have {[i.name for i in self.islands]}")

  def __len__(self) -> int:
    return len(self.islands)
