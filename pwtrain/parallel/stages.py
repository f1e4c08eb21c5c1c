"""Stage slicing: which layers each pipeline stage holds, and moving state between the whole-model
layout (used by checkpoints) and per-stage layouts.

A stage's parameters are a sub-dict of the model's: `blocks` renumbered from 0, plus the
`embedding` on the first stage and `final_norm` on the last; the output layer on the last is the
shared `embedding` (a tied output layer, held by both ends) or its own `unembedding`. Optimizer
states contain param-shaped dicts at several places; they are sliced the same way wherever they
occur.

Scanned layers (`model.scan_layers`, models/scan.py): a model's blocks are `layers`, stacked by
period, and a stage's are the periods of its layers (`to_stage` slices the stacks). Stage
boundaries then fall on period boundaries (moe.every layers with MoE). The whole-model state
that checkpoints hold is always unrolled (`blocks`), whatever the run's layout: `to_whole` and
`unstack_state` unstack, `stack_state` stacks an unrolled state for a scanned model.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain.errors import ConfigError
from pwtrain.models import arithmetic
from pwtrain.models import scan as scan_lib

UNTIED = "unembedding"  # an untied output layer's matrix (models/palm.py)


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  start: int  # first layer (global index)
  stop: int  # one past the last layer
  first: bool
  last: bool

  @property
  def num_layers(self) -> int:
    return self.stop - self.start

  def model_kwargs(self) -> dict:
    return {
      "num_layers": self.num_layers,
      "has_embed": self.first,
      "has_head": self.last,
      "layer_offset": self.start,  # the MoE schedule counts global layers
    }

  def counted(self, params: dict) -> dict:
    """The share of a param-shaped dict of this stage (gradients, parameters) that whole-model
    norms count: the shared embedding, held by the first and the last stage, on the first only,
    so that the stages' squared norms add up to the whole model's."""
    return {k: v for k, v in params.items() if self.first or k != "embedding"}


def balanced_boundaries(costs: list[float], num_stages: int, first_extra=0.0, last_extra=0.0):
  """Contiguous split of layers into stages minimising the most expensive stage (exact DP).

  The embedding's cost counts toward the first stage and the output layer's toward the last.
  Every stage gets at least one layer.
  """
  n = len(costs)
  prefix = np.concatenate([[0.0], np.cumsum(costs)])

  def cost(stage, a, b):
    extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
    return prefix[b] - prefix[a] + extra

  # best[s][b]: minimal max-cost splitting layers [0, b) into s + 1 stages; arg for recovery.
  best = np.full((num_stages, n + 1), np.inf)
  arg = np.zeros((num_stages, n + 1), dtype=int)
  for b in range(1, n + 1):
    best[0][b] = cost(0, 0, b)
  for s in range(1, num_stages):
    for b in range(s + 1, n + 1):
      for a in range(s, b):
        value = max(best[s - 1][a], cost(s, a, b))
        if value < best[s][b]:
          best[s][b], arg[s][b] = value, a
  bounds = [n]
  for s in range(num_stages - 1, 0, -1):
    bounds.append(int(arg[s][bounds[-1]]))
  return [0, *reversed(bounds)]


def num_units(config) -> int:
  """How many groups of layers stages are cut from: layers, or scanned periods of MoE layers."""
  return config.model.num_layers // scan_lib.unit(config.model, config.moe)


def make_stages(config, num_stages: int | None = None) -> list[Stage]:
  """`parallel.stages` stages (or `num_stages` chunks, e.g. exchange buckets, or the interleaved
  schedule's S·v chunks, of equal layers) of the layers.

  Scanned with MoE, stages are cut from whole periods of moe.every layers (models/scan.py)."""
  p, num_layers = config.parallel, config.model.num_layers
  chunks = p.stages * p.virtual_stages if p.schedule == "interleaved" else p.stages
  explicit = num_stages is None or num_stages == chunks
  num_stages = p.stages if num_stages is None else num_stages
  unit = scan_lib.unit(config.model, config.moe)
  units = num_layers // unit
  if num_stages > units:
    raise ConfigError(
      f"parallel.stages={num_stages} exceeds model.num_layers={num_layers}: every stage needs "
      "at least one layer"
      if unit == 1
      else f"parallel.stages={num_stages} exceeds the {units} periods of moe.every={unit} "
      f"layers that model.scan_layers=True scans (model.num_layers={num_layers}): every stage "
      "needs at least one period"
    )
  example = [unit * b for b in balanced_boundaries([1.0] * units, num_stages)]
  if explicit and p.stage_boundaries is not None:
    bounds = [int(b) for b in p.stage_boundaries]
    if (
      len(bounds) != num_stages + 1
      or bounds[0] != 0
      or bounds[-1] != num_layers
      or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
      raise ConfigError(
        f"parallel.stage_boundaries={tuple(bounds)} must be {num_stages + 1} strictly increasing "
        f"layer indices from 0 to model.num_layers={num_layers}, e.g. {tuple(example)}"
      )
    if any(b % unit for b in bounds):
      raise ConfigError(
        f"parallel.stage_boundaries={tuple(bounds)} must fall on period boundaries: "
        f"model.scan_layers=True scans periods of moe.every={unit} layers, so every boundary "
        f"must be a multiple of {unit}, e.g. {tuple(example)}"
      )
  elif p.schedule == "interleaved" and num_stages == chunks:
    if units % num_stages:
      raise ConfigError(
        f"parallel.schedule='interleaved' cuts the {units} periods of model.scan_layers=True "
        f"into {num_stages} equal chunks (parallel.stages x parallel.virtual_stages): choose "
        "a product that divides them"
      )
    bounds = [unit * (units // num_stages) * c for c in range(num_stages + 1)]
  else:
    costs, embed, head = arithmetic.layer_costs(config.model, config.moe, config.data.seq_len)
    unit_costs = [sum(costs[u * unit : (u + 1) * unit]) for u in range(units)]
    bounds = [unit * b for b in balanced_boundaries(unit_costs, num_stages, embed, head)]
  return [
    Stage(s, bounds[s], bounds[s + 1], s == 0, s == num_stages - 1) for s in range(num_stages)
  ]


def is_param_dict(x) -> bool:
  """A dict shaped like the model's parameters (unrolled or scanned), wherever it is in a state."""
  return isinstance(x, dict) and ("blocks" in x or scan_lib.STACKED in x)


# -- a stacked leaf: an array (on the host or on devices), or its abstract value -----------------

# Optax's placeholder for a state a parameter does not use (Adafactor's row and column
# statistics of a parameter it does not factor, its full statistic of one it does): shape (1,)
# whatever the parameter's shape, so one in either layout, the same for every layer. Every
# other leaf of a param-shaped dict is a layer's, stacked along the leading axis when scanned
# (a state of a parameter's shape, or of a factor of it: one dimension or more per layer).
_SHARED = (1,)


def _shared(leaf) -> bool:
  return tuple(getattr(leaf, "shape", ())) == _SHARED


def _length(tree) -> int | None:
  """How many layers the stacks of the param-shaped dicts in `tree` hold (None: no stack)."""
  lengths = set()

  def visit(x):
    if is_param_dict(x) and scan_lib.STACKED in x:
      for leaf in jax.tree.leaves(x[scan_lib.STACKED], is_leaf=_is_axes):
        if not _is_axes(leaf) and not _shared(leaf):
          lengths.add(leaf.shape[0])
    return x

  jax.tree.map(visit, tree, is_leaf=is_param_dict)
  if len(lengths) > 1:
    raise ValueError(f"stacks of different lengths {sorted(lengths)} in one state")
  return lengths.pop() if lengths else None


def _entries(leaf, length: int) -> list:
  """A stacked leaf's entries along its leading ("layers") axis; a shared one's (`_SHARED`),
  itself for each of the `length` layers."""
  if _shared(leaf):
    return [leaf] * length
  if isinstance(leaf, jax.ShapeDtypeStruct):
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):  # the layers axis is never split (sharding.py)
      sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)] * leaf.shape[0]
  if isinstance(leaf, np.ndarray):
    return list(leaf)
  if isinstance(leaf, jax.Array):
    return list(_split(leaf))
  raise TypeError(
    f"cannot unstack a {type(leaf).__name__} of scanned layers (model.scan_layers=True): "
    "arrays held by remote island workers are not supported with scanned layers"
  )


@jax.jit
def _split(x):
  return tuple(x[i] for i in range(x.shape[0]))


def _stack(leaves: list):
  if all(_shared(x) for x in leaves):  # one for all the layers (`_SHARED`)
    return leaves[0]
  if all(isinstance(x, np.ndarray) for x in leaves):
    return np.stack(leaves)
  return jnp.stack(leaves)


def _is_axes(x) -> bool:
  return isinstance(x, tuple)  # a leaf's logical axis names (step.ModelFns.logical_axes)


def _slice(leaf, start: int, stop: int):
  """Entries [start, stop) of a stacked leaf; a leaf's logical axis names stay as they are."""
  if isinstance(leaf, tuple) or _shared(leaf):
    return leaf
  if isinstance(leaf, jax.ShapeDtypeStruct):
    shape = (stop - start, *leaf.shape[1:])
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=leaf.sharding)
  return leaf[start:stop]


# -- param-shaped dicts ---------------------------------------------------------------------------


def unstacked(params: dict, length: int | None = None) -> dict:
  """Param-shaped dict -> its unrolled layout (`blocks`); unrolled ones as they are. `length`:
  the layers its stacks hold (by default, its own leaves say)."""
  if scan_lib.STACKED not in params:
    return params
  length = length or _length(params)
  out = {k: v for k, v in params.items() if k != scan_lib.STACKED}
  blocks = scan_lib.unstack(params[scan_lib.STACKED], lambda leaf: _entries(leaf, length))
  return {**out, "blocks": blocks}


def stacked(params: dict, period: int) -> dict:
  """Unrolled param-shaped dict -> the scanned layout of `period` layers per period."""
  out = {k: v for k, v in params.items() if k != "blocks"}
  return {**out, scan_lib.STACKED: scan_lib.stack(params["blocks"], period, _stack)}


def unstack_state(tree):
  """Every param-shaped dict in `tree` unrolled: a state as checkpoints hold it."""
  length = _length(tree)  # the params' stacks say it for an optimizer's shared leaves
  return jax.tree.map(
    lambda x: unstacked(x, length) if is_param_dict(x) else x, tree, is_leaf=is_param_dict
  )


def stack_state(tree, period: int):
  """Every (unrolled) param-shaped dict in `tree` stacked by `period` layers (models/scan.py)."""
  return jax.tree.map(
    lambda x: stacked(x, period) if is_param_dict(x) else x, tree, is_leaf=is_param_dict
  )


def slice_params(params: dict, stage: Stage) -> dict:
  if scan_lib.STACKED in params:
    layers = params[scan_lib.STACKED]
    n = len(layers)  # layers per period
    a, b = stage.start // n, stage.stop // n
    out = {scan_lib.STACKED: jax.tree.map(lambda x: _slice(x, a, b), layers, is_leaf=_is_axes)}
  else:
    out = {"blocks": {k: params["blocks"][stage.start + k] for k in range(stage.num_layers)}}
  tied = UNTIED not in params
  if stage.first or (stage.last and tied):
    out["embedding"] = params["embedding"]
  if stage.last:
    out["final_norm"] = params["final_norm"]
    if not tied:
      out[UNTIED] = params[UNTIED]
  return out


def to_stage(tree, stage: Stage):
  """Whole-model state (or any tree holding param-shaped dicts) -> the stage's share, in the
  same layout (a scanned model's stacks sliced to the stage's periods)."""
  return jax.tree.map(
    lambda x: slice_params(x, stage) if is_param_dict(x) else x, tree, is_leaf=is_param_dict
  )


def merge_params(parts: list[dict], stages: list[Stage], lengths=None) -> dict:
  """The stages' param-shaped dicts `parts` -> the whole model's, unrolled; `lengths`: the
  layers each stage's stacks hold (by default, their own leaves say)."""
  blocks = {}
  lengths = lengths or [None] * len(parts)
  for part, stage, length in zip(parts, stages, lengths, strict=True):
    part_blocks = unstacked(part, length)["blocks"]
    for k in range(stage.num_layers):
      blocks[stage.start + k] = part_blocks[k]
  # A shared embedding is identical on the first and last stage; the first stage's is kept.
  whole = {"blocks": blocks, "embedding": parts[0]["embedding"]}
  whole["final_norm"] = parts[-1]["final_norm"]
  if UNTIED in parts[-1]:
    whole[UNTIED] = parts[-1][UNTIED]
  return whole


def to_whole(trees: list, stages: list[Stage]):
  """Per-stage states -> the whole-model state, unrolled (the checkpoint layout); non-param
  leaves are taken from stage 0."""
  lengths = [_length(tree) for tree in trees]
  return jax.tree.map(
    lambda *xs: merge_params(list(xs), stages, lengths) if is_param_dict(xs[0]) else xs[0],
    *trees,
    is_leaf=is_param_dict,
  )
