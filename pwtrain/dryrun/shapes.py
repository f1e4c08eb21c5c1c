"""The plan and the train state on paper: shapes (nothing allocated), each device's bytes.

`model_fns` gives the whole model's abstract params and logical axes quickly, `abstract_state`
the whole-model train state as ShapeDtypeStructs, built by the same function a run uses
(pipeline.state.train_state, so it holds whatever the plan's exchange carries), and
`stage_device_bytes` one device's bytes of every leaf of a stage's share of it, from the leaf's
PartitionSpec (spmd.state_shardings, as a run shards it) and the mesh's axis sizes.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from pwtrain import step as step_lib
from pwtrain.backend.cluster import Cluster, Island
from pwtrain.dryrun import hardware
from pwtrain.models import moe as moe_lib
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel import spmd
from pwtrain.parallel.exchange import Exchange
from pwtrain.parallel.pipeline.state import train_state
from pwtrain.parallel.stages import Stage, to_stage


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
  model's: shapes only, not for running. A scanned model (model.scan_layers) is built as it is,
  stacked: its blocks are one period's, vmapped over the periods.
  """
  if model_cfg.scan_layers:
    fns = step_lib.model_fns(model_cfg, moe)
    return _ShapeOnlyFns(fns.graphdef, fns.abstract_params, fns.logical_axes, model_cfg, moe)
  period = min(moe.every, model_cfg.num_layers) if moe_lib.enabled(moe) else 1
  one = step_lib.model_fns(model_cfg, moe, num_layers=period)

  def widen(tree):
    blocks = {i: tree["blocks"][i % period] for i in range(model_cfg.num_layers)}
    return {**tree, "blocks": blocks}

  return _ShapeOnlyFns(
    one.graphdef, widen(one.abstract_params), widen(one.logical_axes), model_cfg, moe
  )


def abstract_state(fns, tx, seed: int, exchange: Exchange, reference: bool = False) -> dict:
  """The whole-model train state as ShapeDtypeStructs: step, params, opt_state, rng, the
  entries `exchange` adds (stale gradients, DiLoCo's anchor, error-feedback residuals), and with
  `reference` the reference policy's params (objectives.holds_reference)."""
  return jax.eval_shape(lambda: train_state(fns, tx, seed, exchange, reference=reference))


def shard_bytes(leaf, sharding, mesh_shape: dict[str, int]) -> int:
  """Bytes of one device's shard: each dim divided (rounded up) by its mesh axes' sizes."""
  n = 1
  spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
  for dim, axes in zip(leaf.shape, spec, strict=True):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    n *= -(-dim // math.prod(mesh_shape[a] for a in axes))
  return n * jnp.dtype(leaf.dtype).itemsize


def tree_bytes(tree) -> int:
  """Bytes of all of a tree's (abstract) arrays, unsharded."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def stage_device_bytes(whole: dict, fns, stage: Stage, mesh_shape: dict[str, int]) -> dict:
  """{state key: one device's bytes of that entry} of `stage`'s share of the `whole` state, on
  an island of `mesh_shape`."""
  mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  state = to_stage(whole, stage)
  stage_fns = dataclasses.replace(fns, logical_axes=to_stage(fns.logical_axes, stage))
  shardings = spmd.state_shardings(stage_fns, mesh, state)
  per_leaf = jax.tree.map(lambda a, s: shard_bytes(a, s, mesh_shape), state, shardings)
  return {key: sum(jax.tree.leaves(tree)) for key, tree in per_leaf.items()}


# -- the plan on a virtual cluster ---------------------------------------------------------------


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
  """The vocabulary rounded up to a multiple of the tensor axis, as XLA pads uneven shards."""
  return -(-vocab_size // tensor) * tensor


def virtual_cluster(config) -> Cluster:
  """`parallel.islands` islands of `parallel.devices_per_island` device ids (0: the cluster's
  devices split over the islands: hardware.topology's, else the local ones): what the plan
  needs, with no devices behind it."""
  per = plan_lib.island_sizes(config, hardware.cluster_devices(config))[0]  # islands are alike
  return Cluster(
    tuple(
      Island(f"island{i}", tuple(range(i * per, (i + 1) * per)))
      for i in range(config.parallel.islands)
    )
  )


def build_plan(config) -> plan_lib.Plan:
  """plan.build on the virtual cluster, for the vocabulary padded to the tensor axis.

  plan.build requires parallel.tensor to divide model.vocab_size, which PaLM's 256000 and
  12-way tensor parallelism do not; the planner sees the vocabulary padded to a multiple of
  the tensor axis (the padding rows are what XLA adds to the uneven shards).
  """
  cluster = virtual_cluster(config)
  mesh_shape = plan_lib.resolve_mesh_shape(config.parallel, cluster.islands[0].num_devices)
  checked = config.copy_and_resolve_references()
  checked.model.vocab_size = padded_vocab_size(config.model.vocab_size, mesh_shape["tensor"])
  return plan_lib.build(checked, cluster)
