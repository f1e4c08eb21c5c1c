"""The training step as pure functions: loss -> gradients -> (accumulate) -> update.

State is a plain dict {"step", "params", "opt_state", "rng"} (plus "reference", the frozen
reference policy's params, when the objective holds one) so that Orbax can save it and every
parallel layout can shard it. What is minimised is the run's objective (objectives.py). Losses
are carried as sums with their token counts until the very end, so that microbatches, data
shards and pods combine exactly.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pwtrain import objectives, optim
from pwtrain.models import PaLM, lm_loss
from pwtrain.models import moe as moe_lib
from pwtrain.sharding import constrain

STAT_KEYS = objectives.LanguageModeling.stat_keys  # the LM objective's
EVAL_KEYS = ("ce_sum", "z_sum", "tokens")  # what an evaluation sums (no MoE aux losses)


@dataclasses.dataclass(frozen=True)
class ModelFns:
  """The functional core of the NNX model: a graph definition plus pure-dict parameters."""

  graphdef: nnx.GraphDef
  abstract_params: dict
  logical_axes: dict  # same tree as params; leaves are tuples of logical dim names
  cfg: object
  moe: object = None  # the moe config (None or num_experts=0: dense)

  def init(self, key) -> dict:
    model = PaLM(self.cfg, moe=self.moe, rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(model))

  def module(self, params) -> PaLM:
    return nnx.merge(self.graphdef, params)


def model_fns(model_cfg, moe=None, **stage) -> ModelFns:
  """The whole model, or with `stage` (num_layers, has_embed, has_head, layer_offset) one
  pipeline stage; `moe` is the moe config."""
  abstract = nnx.eval_shape(lambda: PaLM(model_cfg, moe=moe, rngs=nnx.Rngs(0), **stage))
  graphdef, state = nnx.split(abstract)
  axes = jax.tree.map(
    lambda v: tuple(v.get_metadata()["axes"]),
    state,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )
  return ModelFns(graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(axes), model_cfg, moe)


def init_state(
  fns: ModelFns,
  tx: optax.GradientTransformation,
  seed: int,
  params=None,
  *,
  reference: bool = False,
) -> dict:
  """The state at step 0: `fns.init`'s parameters, or `params` given (an imported model's, or
  another run's); with `reference` (objectives: `holds_reference`) also a frozen copy of them
  as "reference", the policy a KL penalty measures against."""
  key = jax.random.key(seed)
  params_key, rng = jax.random.split(key)
  params = fns.init(params_key) if params is None else params
  state = {
    "step": jnp.zeros((), jnp.int32),
    "params": params,
    "opt_state": tx.init(params),
    "rng": jax.random.key_data(rng),
  }
  if reference:
    state["reference"] = jax.tree.map(jnp.copy, params)
  return state


def loss_and_grads(fns: ModelFns, *, z_loss: float | None = None, objective=None) -> Callable:
  """(params, batch[, reference]) -> (grads of the summed loss, stats).

  The loss and its stats are `objective`'s (objectives.py; default: the LM objective with
  `z_loss`), plus "loss_sum"; `batch` holds its columns. `reference` (the reference policy's
  params) gives the objective the reference's logits of the same inputs (no gradient). An MoE
  model's summed loss adds its weighted aux losses, and its stats the MoE sums (models/moe.py
  STAT_KEYS).
  """
  objective = objective or objectives.LanguageModeling(z_loss)

  def loss_fn(params, batch, reference=None):
    inputs = batch["inputs"]
    rngs = moe_lib.jitter_rngs(fns.moe, inputs)
    logits, moe_stats = fns.module(params).forward(inputs, train=True, rngs=rngs)
    ref_logits = None
    if reference is not None:
      ref_logits = fns.module(reference).forward(inputs, train=True, rngs=rngs)[0]
      ref_logits = jax.lax.stop_gradient(ref_logits)
    labels = {k: batch[k] for k in objective.label_columns}
    total, stats = objective.loss(logits, labels, ref_logits)
    if moe_stats:
      total = total + moe_lib.weighted_aux(fns.moe, moe_stats)
    return total, {**stats, **moe_stats}

  def fn(params, batch, reference=None):
    (total, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, reference)
    return grads, {"loss_sum": total, **stats}

  fn.merge = lambda a, b: (jax.tree.map(jnp.add, a[0], b[0]), objective.merge(a[1], b[1]))
  return fn


def token_logprobs(fns: ModelFns, objective) -> Callable:
  """(params, batch) -> [b, L] float32: each target's log-prob under `objective`'s distribution
  (GRPO's: the sampled one, objectives.py), 0 where the target is negative, from the forward
  pass the train step differentiates (train=True): what the trainer's ratio uses."""

  def fn(params, batch):
    rngs = moe_lib.jitter_rngs(fns.moe, batch["inputs"])
    logits, _ = fns.module(params).forward(batch["inputs"], train=True, rngs=rngs)
    return objective.logprobs(logits, batch["targets"])

  return fn


def eval_sums(fns: ModelFns, *, z_loss: float) -> Callable:
  """(params, batch) -> {"ce_sum", "z_sum", "tokens"} of the model as used at inference: a
  forward pass only, MoE layers at their eval capacity and without router jitter."""

  def fn(params, batch):
    logits, _ = fns.module(params).forward(batch["inputs"], train=False)
    return lm_loss(logits, batch["targets"], z_loss=z_loss)[1]

  return fn


def accumulate(grad_fn: Callable, num_microbatches: int) -> Callable:
  """Wraps a summed-loss grad_fn (or any function of (params, batch, *rest) whose outputs are
  sums) to run over microbatches in a scan, combining the outputs by `grad_fn.merge` (as
  loss_and_grads' merges its objective's stats: sums added, maxima maxed), else adding them.
  Zeros start the scan, so a statistic combined by its maximum must be >= 0.

  Microbatch m takes rows m, m+M, m+2M, ... so each device keeps its own rows (no resharding).
  """
  if num_microbatches == 1:
    return grad_fn
  merge = getattr(grad_fn, "merge", lambda a, b: jax.tree.map(jnp.add, a, b))

  def split(x):
    x = x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
    return constrain(jnp.swapaxes(x, 0, 1), (None, "batch", "length"))

  def fn(params, batch, *rest):
    micro = jax.tree.map(split, batch)
    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, first, *rest))

    def body(carry, mb):
      return merge(carry, grad_fn(params, mb, *rest)), None

    total, _ = jax.lax.scan(body, zeros, micro)
    return total

  return fn


def sum_of_squares(tree) -> jax.Array:
  return sum((jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def norm_sums(old_params, new_params) -> dict:
  """{"param_sumsq": squared L2 norm of `new_params`, "update_sumsq": that of new - old}: one
  share of the parameter and update norms that `with_norms` reports. A layout whose params are
  split (pipeline stages) passes each share of the model once (stages.Stage.counted)."""
  delta = jax.tree.map(jnp.subtract, new_params, old_params)
  return {"param_sumsq": sum_of_squares(new_params), "update_sumsq": sum_of_squares(delta)}


def with_norms(metrics: dict, sums: list[dict]) -> dict:
  """`metrics` plus "param_norm" (the global L2 norm of the params after the step) and
  "update_norm" (that of the update the step applied: new params - old params, after clipping,
  the learning rate and weight decay; 0 for a skipped step), from the `norm_sums` of every
  share of the model, added in list order."""
  total = {k: sum(s[k] for s in sums) for k in sums[0]}
  return {
    **metrics,
    "param_norm": jnp.sqrt(total["param_sumsq"]),
    "update_norm": jnp.sqrt(total["update_sumsq"]),
  }


def apply_update(
  tx: optax.GradientTransformation, schedule, clip_norm: float, objective=None
) -> Callable:
  """(state, summed grads, summed stats[, sumsq]) -> (new state, metrics).

  Normalises the summed gradients by the token count, clips them to global norm `clip_norm`
  and steps the optimizer. `sumsq` is the squared norm of the summed gradients of the whole
  model; it defaults to that of `grads`, and is passed in when `grads` is one stage's share.
  The metrics are `objective`'s of the stats (default: the LM objective's), plus "grad_norm"
  and "lr".
  """
  objective = objective or objectives.LanguageModeling(0.0)

  def fn(state, grads, stats, sumsq=None):
    tokens = jnp.maximum(stats["tokens"], 1.0)
    sumsq = sum_of_squares(grads) if sumsq is None else sumsq
    grad_norm = jnp.sqrt(sumsq) / tokens
    grads = jax.tree.map(lambda g: g / tokens, grads)
    grads = optim.clip_by_global_norm(grads, grad_norm, clip_norm)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {
      **objective.metrics(stats),
      "grad_norm": grad_norm,
      "lr": schedule(state["step"]),
    }
    new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
    return new_state, metrics

  return fn


def train_step(grad_fn: Callable, update_fn: Callable) -> Callable:
  """(state, batch) -> (new state, metrics): gradients, the update, and its norms."""

  def step(state, batch):
    reference = (state["reference"],) if "reference" in state else ()
    grads, stats = grad_fn(state["params"], batch, *reference)
    new_state, metrics = update_fn(state, grads, stats)
    return new_state, with_norms(metrics, [norm_sums(state["params"], new_state["params"])])

  return step
