"""Stage slicing: which layers each pipeline stage holds, and moving state between the whole-model
layout (used by checkpoints) and per-stage layouts.

A stage's parameters are a sub-dict of the model's: `blocks` renumbered from 0, plus the shared
`embedding` on the first and last stage and `final_norm` on the last. Optimizer states contain
param-shaped dicts at several places; they are sliced the same way wherever they occur.
"""

import dataclasses

import jax
import numpy as np

from pwtrain.models import arithmetic


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


def make_stages(config, num_stages: int | None = None) -> list[Stage]:
  """`parallel.stages` stages (or `num_stages` chunks, e.g. exchange buckets) of the layers."""
  p, num_layers = config.parallel, config.model.num_layers
  explicit = num_stages is None or num_stages == p.stages
  num_stages = p.stages if num_stages is None else num_stages
  if num_stages > num_layers:
    raise ValueError(
      f"parallel.stages={num_stages} exceeds model.num_layers={num_layers}: every stage needs "
      "at least one layer"
    )
  if explicit and p.stage_boundaries is not None:
    bounds = [int(b) for b in p.stage_boundaries]
    if (
      len(bounds) != num_stages + 1
      or bounds[0] != 0
      or bounds[-1] != num_layers
      or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
      raise ValueError(
        f"parallel.stage_boundaries={tuple(bounds)} must be {num_stages + 1} strictly increasing "
        f"layer indices from 0 to model.num_layers={num_layers}, e.g. "
        f"{tuple(balanced_boundaries([1.0] * num_layers, num_stages))}"
      )
  else:
    costs, embed, head = arithmetic.layer_costs(config.model, config.moe, config.data.seq_len)
    bounds = balanced_boundaries(costs, num_stages, embed, head)
  return [
    Stage(s, bounds[s], bounds[s + 1], s == 0, s == num_stages - 1) for s in range(num_stages)
  ]


def _is_param_dict(x) -> bool:
  return isinstance(x, dict) and "blocks" in x


def slice_params(params: dict, stage: Stage) -> dict:
  out = {"blocks": {k: params["blocks"][stage.start + k] for k in range(stage.num_layers)}}
  if stage.first or stage.last:
    out["embedding"] = params["embedding"]
  if stage.last:
    out["final_norm"] = params["final_norm"]
  return out


def to_stage(tree, stage: Stage):
  """Whole-model state (or any tree holding param-shaped dicts) -> the stage's share."""
  return jax.tree.map(
    lambda x: slice_params(x, stage) if _is_param_dict(x) else x, tree, is_leaf=_is_param_dict
  )


def merge_params(parts: list[dict], stages: list[Stage]) -> dict:
  blocks = {}
  for part, stage in zip(parts, stages, strict=True):
    for k in range(stage.num_layers):
      blocks[stage.start + k] = part["blocks"][k]
  # The shared embedding is identical on the first and last stage; the first stage's is kept.
  return {
    "blocks": blocks,
    "embedding": parts[0]["embedding"],
    "final_norm": parts[-1]["final_norm"],
  }


def to_whole(trees: list, stages: list[Stage]):
  """Per-stage states -> the whole-model state; non-param leaves are taken from stage 0."""
  return jax.tree.map(
    lambda *xs: merge_params(list(xs), stages) if _is_param_dict(xs[0]) else xs[0],
    *trees,
    is_leaf=_is_param_dict,
  )
