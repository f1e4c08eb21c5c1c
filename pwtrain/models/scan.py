"""Scanned layers (`model.scan_layers`): the decoder's blocks stacked and run with jax.lax.scan,
so that the step's program holds one period of blocks however deep the model is.

Period. Blocks repeat with the MoE schedule and the sliding-window pattern (models/family.py):
a period is the least common multiple of `moe.every` with MoE (every - 1 dense blocks, then one
MoE block) and `model.sliding_window_pattern` with local layers (Gemma 2: a local and a global
layer), else one layer. A scanned model (or pipeline stage) of n
layers holds, for each position j of the period, one block whose parameters have a
leading "layers" axis of n / period entries: entry p of position j is the stage's layer
p * period + j. So a stage's num_layers and layer_offset must be multiples of the period
(config.validate and parallel/stages.py say so in their errors). In the params:

  unrolled  params["blocks"][i][...]                       layer i
  scanned   params["layers"][j][...][p]  (leading axis p)   layer p * period + j

`stack` and `unstack` convert one layout into the other (checkpoints hold the unrolled one).

Init. A scanned model's parameters are exactly the unrolled model's, stacked: every layer draws
from the same positions of the `params` RNG stream as the unrolled PaLM would (a stream's draw
number c is key fold_in(key, c)), and one period's blocks are created under nnx.vmap over the
periods, so that the init's program does not grow with depth either.

Forward. jax.lax.scan over the periods, the carry being the activation and the summed MoE stats
(added in layer order, as the unrolled loop adds them). `model.remat` applies inside the scan
body, to each block as in the unrolled model (jax.checkpoint with the policy of models/remat.py),
except that at "none" a block is checkpointed too, keeping every matmul's output and recomputing
the elementwise ops between them in the backward (remat.scanned_policy says why: what a scanned
block keeps is stacked over the periods, at a cost the unrolled model does not pay).
Router jitter draws from the caller's `jitter` stream in layer order, as unrolled: the k-th MoE
layer run draws number c + k (c: the stream's count before the blocks), and the stream's count
then moves past them.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pwtrain.errors import ConfigError
from pwtrain.models import family as family_lib
from pwtrain.models import moe as moe_lib
from pwtrain.models import remat as remat_lib
from pwtrain.models.blocks import make_block

STACKED = "layers"  # the params key of a scanned model's blocks (unrolled: "blocks")


def period(model_cfg, moe) -> int:
  """Layers per scanned period: the lcm of moe.every (with MoE) and the sliding-window pattern
  (with local and global layers); 1 when every layer is alike."""
  every = moe.every if moe_lib.enabled(moe) else 1
  return math.lcm(every, family_lib.of(model_cfg).window_period)


def unit(model_cfg, moe) -> int:
  """Layers that stage boundaries must group: the period when `model.scan_layers`, else 1."""
  return period(model_cfg, moe) if model_cfg.scan_layers else 1


class _DrawCounter:
  """Stands in for nnx.Rngs to count a block's draws from its `params` stream."""

  def __init__(self):
    self.draws = 0

  @property
  def params(self):
    return self._draw

  def _draw(self):
    self.draws += 1
    return jax.random.key(0)


def _draws(make_block) -> int:
  """How many keys `make_block(rngs=...)` draws (counted while tracing its shapes)."""
  counter = _DrawCounter()

  def build():
    make_block(rngs=counter)

  jax.eval_shape(build)
  return counter.draws


def _rngs_at(name: str, key, count) -> nnx.Rngs:
  """An Rngs whose stream `name` is at draw number `count` of `key`."""
  rngs = nnx.Rngs(**{name: key})
  getattr(rngs, name).count[...] = count
  return rngs


def _from_draw(make_block, key):
  """count -> make_block drawing from `key`'s params stream from draw number `count` on."""
  return lambda count: make_block(rngs=_rngs_at("params", key, count))


def stacked_blocks(
  cfg, *, rngs: nnx.Rngs, num_layers: int, moe, layer_offset: int, param_dtype
) -> nnx.List:
  """One block per position of the period, its parameters stacked over the periods (logical
  axis "layers" first), initialised as the unrolled blocks would be (module docstring).
  Advances rngs.params past every layer's draws."""
  n = period(cfg, moe)
  if num_layers % n or layer_offset % n:
    raise ConfigError(
      f"model.scan_layers=True scans periods of {n} layers (moe.every, "
      f"model.sliding_window_pattern): a model or stage of {num_layers} layers from layer "
      f"{layer_offset} is not made of whole periods"
    )
  makes = [
    functools.partial(
      make_block,
      cfg,
      param_dtype=param_dtype,
      moe=moe if moe_lib.is_moe_layer(moe, layer_offset + j) else None,
      layer=layer_offset + j,
    )
    for j in range(n)
  ]
  draws = [_draws(make) for make in makes]
  stream = rngs.params
  key, start = stream.key[...], stream.count[...]
  periods = jnp.arange(num_layers // n, dtype=start.dtype)
  blocks = []
  for j, make in enumerate(makes):
    first = start + sum(draws[:j]) + sum(draws) * periods  # layer p * n + j's first draw
    block = nnx.vmap(_from_draw(make, key))(first)
    for _, variable in nnx.iter_graph(block):
      if isinstance(variable, nnx.Variable):
        variable.set_metadata("axes", (STACKED, *variable.get_metadata()["axes"]))
    blocks.append(block)
  stream.count[...] = start + sum(draws) * (num_layers // n)
  return nnx.List(blocks)


def num_periods(layers: nnx.List) -> int:
  return jax.tree.leaves(nnx.state(layers[0]))[0].shape[0]


def run(
  layers: nnx.List, x, positions, start: int, stop: int, *, train, rngs, remat: str, num_experts
):
  """Periods [start, stop) of the stacked `layers` on x: (x, the blocks' summed MoE stats, as
  moe.zero_stats(num_experts) + each block's). `train`, `rngs` as PaLM.forward; `remat` a
  models/remat.py policy."""
  splits = [nnx.split(block) for block in layers]
  states = [jax.tree.map(lambda a: a[start:stop], state) for _, state in splits]
  is_moe = [block.is_moe for block in layers]
  jitter = train and rngs is not None and any(b.is_moe and b.moe.jitter > 0 for b in layers)
  key, first = (rngs.jitter.key[...], rngs.jitter.count[...]) if jitter else (None, None)
  moe_per_period = sum(is_moe)

  def block_fn(graphdef):
    def fn(state, x, key, count):
      block = nnx.merge(graphdef, state)
      block_rngs = None if key is None else _rngs_at("jitter", key, count)
      return block.with_stats(x, positions, train=train, rngs=block_rngs)

    return jax.checkpoint(fn, policy=remat_lib.scanned_policy(remat), prevent_cse=False)

  fns = [block_fn(graphdef) for graphdef, _ in splits]

  def body(carry, xs):
    x, stats = carry
    p, period_states = xs
    k = 0  # MoE layers before this one in the period
    for j, fn in enumerate(fns):
      count = None if key is None or not is_moe[j] else first + p * moe_per_period + k
      x, block_stats = fn(period_states[j], x, key if is_moe[j] else None, count)
      stats = moe_lib.add_stats(stats, block_stats)
      k += is_moe[j]
    return (x, stats), None

  periods = jnp.arange(stop - start, dtype=jnp.uint32)
  carry = (x, moe_lib.zero_stats(num_experts))
  (x, stats), _ = jax.lax.scan(body, carry, (periods, states))
  if jitter:
    rngs.jitter.count[...] = first + (stop - start) * moe_per_period
  return x, stats


# -- the two layouts of a model's parameters (or of any tree shaped like them) --------------------


def _is_axes(x) -> bool:
  return isinstance(x, tuple)  # a leaf's logical axis names (step.ModelFns.logical_axes)


def stack(blocks: dict, period_: int, stack_leaves) -> dict:
  """Unrolled {i: block tree} (i = 0..n-1, n a multiple of `period_`) -> scanned {j: tree}
  whose leaves are `stack_leaves([leaf of layer j, of layer period_ + j, ...])`."""
  n = len(blocks)
  return {
    j: jax.tree.map(
      lambda *leaves: stack_leaves(list(leaves)),
      *[blocks[i] for i in range(j, n, period_)],
      is_leaf=_is_axes,
    )
    for j in range(period_)
  }


def unstack(layers: dict, entries) -> dict:
  """Scanned {j: tree} -> unrolled {i: tree}; `entries(leaf)` lists a stacked leaf's entries
  along its leading axis."""
  period_, blocks = len(layers), {}
  for j, tree in layers.items():
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_axes)
    split = [entries(leaf) for leaf in leaves]
    for p in range(len(split[0])):
      blocks[p * period_ + int(j)] = treedef.unflatten([s[p] for s in split])
  return dict(sorted(blocks.items()))
