"""Sparse Mixture-of-Experts FFN: router, capacity-based or dropless dispatch, gated experts.

Routing, in float32: probs = softmax(x W_router) over the experts; each token picks its `top_k`
most probable experts (ties go to the lower index, as in lax.top_k). The gates are the chosen
probabilities; with top_k > 1 (GShard) they are renormalised to sum to 1, with top_k = 1 (Switch)
the raw probability is kept so that the router gets a gradient. With `jitter` > 0 the router's
input is multiplied by uniform noise in [1 - jitter, 1 + jitter] while training (Switch).

Capacity and the drop order. Tokens are routed in groups of one sequence (a row of the batch), so
which tokens drop depends on that sequence alone, never on how the batch is split over devices,
microbatches or pods. In a group of S tokens each expert serves at most
C = min(S, ceil(top_k * capacity_factor * S / num_experts)) assignments (token, choice). They are
served choice by choice and, within a choice, in token order: every token's first choice in
position order, then every token's second choice, ... An assignment whose expert is already full
is dropped and contributes nothing: the token keeps its other choices' outputs (gates are not
renormalised), and a token with every choice dropped gets zero MoE output and passes through the
block's residual. `dropless` serves every assignment: tokens sorted by expert, grouped matmuls
(lax.ragged_dot), no capacity.

Expert parallelism: experts are split over the "expert" logical axis, tokens over "batch" (which
includes the expert mesh axis). The dispatched tensor [expert, group, capacity, embed] is
constrained to have experts on the expert axis, so XLA inserts the all-to-all that sends each
token to its expert's devices, and another to bring the outputs back. The dropless path has no
static per-expert shapes, so XLA gathers its tokens instead of exchanging them all-to-all.

Auxiliary losses, carried as sums (like the LM loss) so that shards, microbatches, stages and
pods add up exactly; every sum is over MoE layers too (`stats`):
  moe_aux_sum      sum over groups of S * aux_g, where aux_g = E * sum_e f_e P_e is the
                   Switch/GShard load-balancing loss of the group (f_e: fraction of the group's
                   tokens whose first choice is e; P_e: mean router probability of e); 1 when
                   balanced
  moe_z_sum        sum over tokens of logsumexp(router logits)^2 (ST-MoE router z-loss)
  moe_dropped      assignments dropped for capacity
  moe_assignments  assignments routed (tokens * top_k)
  moe_load         [num_experts] assignments routed to each expert, before capacity
The training loss adds aux_loss_weight * moe_aux_sum + router_z_loss_weight * moe_z_sum to the
summed LM loss, which the update divides by the step's target-token count like everything else.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pwtrain.models.layers import ACTIVATIONS
from pwtrain.sharding import constrain

STAT_KEYS = ("moe_aux_sum", "moe_z_sum", "moe_dropped", "moe_assignments", "moe_load")


def enabled(moe_cfg) -> bool:
  return moe_cfg is not None and moe_cfg.num_experts > 0


def is_moe_layer(moe_cfg, layer: int) -> bool:
  """Layer `layer` (global index, from 0) is MoE when (layer + 1) is a multiple of `every`."""
  return enabled(moe_cfg) and (layer + 1) % moe_cfg.every == 0


def expert_d_ff(model_cfg, moe_cfg) -> int:
  """Each expert's hidden size: moe.d_ff, or 0 for model.d_ff // top_k, so that the top_k experts
  a token uses have the dense FFN's parameters and FLOPs (also after overriding top_k)."""
  return moe_cfg.d_ff or model_cfg.d_ff // moe_cfg.top_k


def capacity(group_size: int, num_experts: int, top_k: int, factor: float) -> int:
  return max(1, min(group_size, math.ceil(top_k * factor * group_size / num_experts)))


def zero_stats(num_experts: int) -> dict:
  """The stats of no MoE layer: {} for a dense model (0 experts), else zeros of every stat."""
  if not num_experts:
    return {}
  stats = {k: jnp.zeros((), jnp.float32) for k in STAT_KEYS}
  stats["moe_load"] = jnp.zeros((num_experts,), jnp.float32)
  return stats


def add_stats(a: dict, b: dict) -> dict:
  return {k: a[k] + b[k] for k in a} if b else a


def weighted_aux(moe_cfg, stats: dict):
  """What the MoE layers add to the summed training loss."""
  return (
    moe_cfg.aux_loss_weight * stats["moe_aux_sum"]
    + moe_cfg.router_z_loss_weight * stats["moe_z_sum"]
  )


def metrics(moe_cfg, stats: dict) -> dict:
  """Per-step MoE metrics from the step's summed stats.

  moe_aux_loss and moe_z_loss are normalised like the LM loss (per target token), so that
  loss = ce_loss + z_loss + aux_loss_weight * moe_aux_loss + router_z_loss_weight * moe_z_loss.
  moe_load_e{i} is expert i's share of the assignments times num_experts (1 = uniform).
  """
  tokens = jnp.maximum(stats["tokens"], 1.0)
  assignments = jnp.maximum(stats["moe_assignments"], 1.0)
  load = stats["moe_load"] / assignments * moe_cfg.num_experts
  out = {
    "moe_aux_loss": stats["moe_aux_sum"] / tokens,
    "moe_z_loss": stats["moe_z_sum"] / tokens,
    "moe_dropped_fraction": stats["moe_dropped"] / assignments,
    "moe_load_max": jnp.max(load),
    "moe_load_min": jnp.min(load),
  }
  out.update({f"moe_load_e{i}": load[i] for i in range(moe_cfg.num_experts)})
  return out


def with_metrics(moe_cfg, update_fn):
  """Wraps an (state, grads, stats, ...) -> (state, metrics) update to add the MoE metrics."""

  def fn(state, grads, stats, *args):
    new_state, out = update_fn(state, grads, stats, *args)
    return new_state, {**out, **metrics(moe_cfg, stats)}

  return fn


def input_key(x: jax.Array) -> jax.Array:
  """A PRNG key that is a hash of x's bits (integer sums wrap, so any reduction order agrees).

  The jitter noise is keyed by the model's (or a pipeline stage's) input: it needs no state,
  replays exactly on resume, and a stage's re-materialising backward sees the forward's noise.
  """
  if x.dtype.itemsize == 4:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    bits = bits.astype(jnp.uint32)
  weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  digest = jnp.sum(bits.reshape(-1) * weights, dtype=jnp.uint32)
  return jax.random.fold_in(jax.random.key(0), digest)


def jitter_rngs(moe_cfg, x) -> nnx.Rngs | None:
  """The rng stream for router jitter while training; None (no randomness) when jitter is 0."""
  if not enabled(moe_cfg) or moe_cfg.jitter == 0:
    return None
  return nnx.Rngs(jitter=input_key(x))


def top_k_gates(logits, top_k: int):
  """float32 router logits [..., E] -> (probs [..., E], gates [..., k], expert ids [..., k])."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  gates, experts = jax.lax.top_k(probs, top_k)
  if top_k > 1:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return probs, gates, experts


def dispatch_plan(experts, gates, num_experts: int, capacity_: int):
  """Which assignment goes to which expert slot, in the module docstring's drop order.

  experts, gates: [G, S, k]. Returns dispatch [G, S, E, C] (0/1), combine [G, S, E, C] (the
  gate at the token's slot) and kept [G, S, k] (whether each assignment was served).
  """
  g, s, k = experts.shape
  # Choice-major order: [G, k*S, E], so that a cumulative sum serves all first choices (in
  # token order) before any second choice.
  onehot = jax.nn.one_hot(jnp.swapaxes(experts, 1, 2), num_experts, dtype=jnp.int32)
  onehot = onehot.reshape(g, k * s, num_experts)
  position = jnp.cumsum(onehot, axis=1) - 1  # slot each assignment takes in its expert
  position = jnp.sum(position * onehot, axis=-1).reshape(g, k, s)
  position = jnp.swapaxes(position, 1, 2)  # [G, S, k]
  kept = position < capacity_
  slot = jax.nn.one_hot(jnp.where(kept, position, capacity_), capacity_, dtype=jnp.float32)
  expert = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)
  # A token's choices are distinct experts, so the k terms never share a slot.
  dispatch = jnp.einsum("gske,gskc->gsec", expert, slot)
  combine = jnp.einsum("gske,gskc,gsk->gsec", expert, slot, gates)
  return dispatch, combine, kept


def aux_stats(logits, probs, experts, kept, num_experts: int) -> dict:
  """The layer's MoE stats (see the module docstring) for groups [G, S, ...]."""
  g, s, k = experts.shape
  first = jax.nn.one_hot(experts[..., 0], num_experts, dtype=jnp.float32)
  # S * aux_g = E * sum_e (first-choice count of e) * (mean prob of e); f_e carries no gradient.
  aux = num_experts * jnp.sum(jnp.sum(first, axis=1) * jnp.mean(probs, axis=1))
  log_z = jax.nn.logsumexp(logits, axis=-1)
  load = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=(0, 1, 2))
  return {
    "moe_aux_sum": aux,
    "moe_z_sum": jnp.sum(jnp.square(log_z)),
    "moe_dropped": jnp.sum(1.0 - kept.astype(jnp.float32)),
    "moe_assignments": jnp.asarray(g * s * k, jnp.float32),
    "moe_load": load,
  }


def gated_experts(x, w_gate, w_up, w_down, act):
  """x [E, G, C, d] through each expert's gated MLP, act(x W_gate) * (x W_up) W_down (expert
  e's weights for x[e])."""
  dtype = x.dtype
  gate = jnp.einsum("egcd,edf->egcf", x, w_gate.astype(dtype))
  up = jnp.einsum("egcd,edf->egcf", x, w_up.astype(dtype))
  hidden = constrain(act(gate) * up, ("expert", "batch", None, "mlp"))
  return jnp.einsum("egcf,efd->egcd", hidden, w_down.astype(dtype))


def capacity_ffn(x, dispatch, combine, w_gate, w_up, w_down, act):
  """GShard dispatch -> experts -> combine. x [G, S, d] -> [G, S, d]."""
  dtype = x.dtype
  expert_in = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dtype), x)
  # Experts onto the expert axis: the all-to-all from token-sharded to expert-sharded.
  expert_in = constrain(expert_in, ("expert", "batch", None, "embed"))
  expert_out = gated_experts(expert_in, w_gate, w_up, w_down, act)
  expert_out = constrain(expert_out, ("expert", "batch", None, "embed"))
  y = jnp.einsum("egcd,gsec->gsd", expert_out, combine.astype(dtype))
  return constrain(y, ("batch", "length", "embed"))


def dropless_ffn(x, experts, gates, w_gate, w_up, w_down, act):
  """Every assignment served: sort by expert, grouped matmuls, unsort, gate. x [G, S, d]."""
  dtype, (g, s, d), k = x.dtype, x.shape, experts.shape[-1]
  num_experts = w_gate.shape[0]
  flat = experts.reshape(-1)  # assignment n * k + j: token n's choice j
  order = jnp.argsort(flat, stable=True)  # by expert, then token, then choice
  tokens = x.reshape(g * s, d)[order // k]
  sizes = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=0)
  gate = jax.lax.ragged_dot(tokens, w_gate.astype(dtype), sizes)
  up = jax.lax.ragged_dot(tokens, w_up.astype(dtype), sizes)
  out = jax.lax.ragged_dot(act(gate) * up, w_down.astype(dtype), sizes)
  out = out[jnp.argsort(order)].reshape(g, s, k, d)  # back to assignment order
  return jnp.einsum("gskd,gsk->gsd", out, gates.astype(dtype))


def _expert_init():
  # Variance 1/d_in per expert: the expert dim is a batch dim, not part of the fan-in.
  return nnx.initializers.variance_scaling(
    1.0, "fan_in", "normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
  )


class MoE(nnx.Module):
  """A sparse MoE FFN in place of the dense gated MLP: `num_experts` gated experts with the
  family's `activation` (layers.ACTIVATIONS: SwiGLU for PaLM and Llama, GeGLU for Gemma), no
  biases."""

  def __init__(self, cfg, moe_cfg, *, rngs: nnx.Rngs, param_dtype, activation: str):
    d, f, e = cfg.d_model, expert_d_ff(cfg, moe_cfg), moe_cfg.num_experts
    self.num_experts, self.top_k = e, moe_cfg.top_k
    self.activation = activation
    self.capacity_factor = moe_cfg.capacity_factor
    self.eval_capacity_factor = moe_cfg.eval_capacity_factor
    self.dropless, self.jitter = bool(moe_cfg.dropless), float(moe_cfg.jitter)
    init = _expert_init()
    # The router is small and every token needs all of its columns: kept whole over experts.
    self.router = nnx.Param(
      nnx.initializers.variance_scaling(1.0, "fan_in", "normal")(
        rngs.params(), (d, e), param_dtype
      ),
      axes=("embed", None),
    )
    self.w_gate = nnx.Param(
      init(rngs.params(), (e, d, f), param_dtype), axes=("expert", "embed", "mlp")
    )
    self.w_up = nnx.Param(
      init(rngs.params(), (e, d, f), param_dtype), axes=("expert", "embed", "mlp")
    )
    self.w_down = nnx.Param(
      init(rngs.params(), (e, f, d), param_dtype), axes=("expert", "mlp", "embed")
    )

  def route(self, x, *, train: bool, rngs: nnx.Rngs | None = None):
    """x [G, S, d] -> float32 router logits [G, S, E]."""
    h = x.astype(jnp.float32)
    if train and self.jitter > 0 and rngs is not None:
      noise = jax.random.uniform(
        rngs.jitter(), h.shape, jnp.float32, 1.0 - self.jitter, 1.0 + self.jitter
      )
      h = h * noise
    logits = h @ self.router[...].astype(jnp.float32)
    return constrain(logits, ("batch", "length", None))

  def __call__(self, x, *, train: bool, rngs: nnx.Rngs | None = None):
    """x [G, S, d] (one group per sequence) -> (y [G, S, d], this layer's MoE stats)."""
    logits = self.route(x, train=train, rngs=rngs)
    probs, gates, experts = top_k_gates(logits, self.top_k)
    weights = (self.w_gate[...], self.w_up[...], self.w_down[...], ACTIVATIONS[self.activation])
    if self.dropless:
      y = dropless_ffn(x, experts, gates, *weights)
      kept = jnp.ones(experts.shape, bool)
    else:
      factor = self.capacity_factor if train else self.eval_capacity_factor
      cap = capacity(x.shape[1], self.num_experts, self.top_k, factor)
      dispatch, combine, kept = dispatch_plan(experts, gates, self.num_experts, cap)
      y = capacity_ffn(x, dispatch, combine, *weights)
    return y, aux_stats(logits, probs, experts, kept, self.num_experts)
