"""Logical axes -> mesh axes -> NamedShardings, and arrays on shardings that span processes.

Models name logical dimensions ("batch", "embed", "heads", ...). The rules here say which mesh
axis (data, fsdp, tensor, expert) each one is split over. A mesh axis is used at most once per
array: later dims that would reuse it are replicated instead, which lets parameters shard "embed"
over fsdp while activations, whose batch already uses fsdp, keep "embed" whole.
"""

import contextlib
import contextvars
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Mesh axes, outermost first; tensor stays innermost (its all-reduces are the most frequent).
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# (logical dim, mesh axes it is split over). Order matters only for readability.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
  # Tokens are split over the expert axis too: outside the MoE layers it is one more data
  # axis, and the MoE dispatch exchanges tokens over it all-to-all (models/moe.py).
  ("batch", ("data", "fsdp", "expert")),
  ("expert", ("expert",)),
  ("embed", ("fsdp",)),
  ("vocab", ("tensor",)),
  ("heads", ("tensor",)),
  ("mlp", ("tensor",)),
  # Grouped-query attention's K/V heads are split over tensor like the query heads where it
  # divides them; MQA's single K/V head (PaLM), or too few heads, replicated (DIVIDING_ONLY).
  ("kv_heads", ("tensor",)),
  ("head_dim", ()),
  ("length", ()),
  ("norm", ()),
  ("layers", ()),  # scanned layers' stacking axis (models/scan.py): every device holds all layers
)


# Logical dims split only where the mesh axes divide them, else replicated: they need the shape
# (`shape=`; without one they are replicated).
DIVIDING_ONLY = ("kv_heads",)


def logical_to_spec(
  logical_axes: Sequence[str | None], rules=DEFAULT_RULES, shape=None, mesh_shape=None
) -> PartitionSpec:
  """Maps a tuple of logical dim names to a PartitionSpec, using each mesh axis at most once; a
  DIVIDING_ONLY dim is split only when `shape` and `mesh_shape` ({axis: size}) say its axes
  divide it."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    axes = tuple(a for a in table[name] if a not in used)
    if name in DIVIDING_ONLY and (
      shape is None or shape[dim] % math.prod(mesh_shape[a] for a in axes)
    ):
      axes = ()
    used.update(axes)
    spec.append(axes if len(axes) > 1 else (axes[0] if axes else None))
  return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes, rules=DEFAULT_RULES, shape=None) -> NamedSharding:
  """`logical_axes` on `mesh`; `shape`, the array's, lets DIVIDING_ONLY dims be split."""
  return NamedSharding(mesh, logical_to_spec(logical_axes, rules, shape, dict(mesh.shape)))


def tree_shardings(mesh: Mesh, logical_tree, rules=DEFAULT_RULES):
  """A pytree of logical-axis tuples (PartitionSpecs of names) -> NamedShardings."""
  return jax.tree.map(
    lambda names: named_sharding(mesh, tuple(names), rules),
    logical_tree,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pwtrain_sharding", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, rules=DEFAULT_RULES):
  """While tracing under this context, `constrain` pins activations to `mesh`."""
  token = _ACTIVE.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Sharding hint for an activation, by logical names; a no-op outside `activate`."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, named_sharding(mesh, logical_axes, rules, x.shape))


# -- arrays over several processes (distributed mode) ---------------------------------------


def stand_in(info):
  """An array of `info`'s shape, dtype and sharding (a ShapeDtypeStruct's) with no data on this
  process: what a process of a distributed run holds of an array whose shards all live on other
  processes' devices. None for None."""
  if info is None:
    return None
  return jax.make_array_from_single_device_arrays(info.shape, info.sharding, [], dtype=info.dtype)


def from_host(value, info):
  """Host `value` as an array of `info`'s shape, dtype and sharding. Only the shards on this
  process's devices are read from `value`; when it has none, `value` is not read at all (None
  will do) and the result is a `stand_in` (jax.make_array_from_callback would still read a
  replicated value once)."""
  if info.sharding.is_fully_addressable:
    return jax.device_put(value, info.sharding)
  if not info.sharding.addressable_devices:
    return stand_in(info)
  return jax.make_array_from_callback(
    info.shape, info.sharding, lambda index: value[index], dtype=info.dtype
  )
