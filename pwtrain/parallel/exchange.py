"""What crosses pods: gradient compression and the exchange modes.

Pods (data-parallel replicas on separate islands) each compute gradients of their share of the
global batch; the exchange makes every pod apply the same update, PaLM-style:
  sync        each pod sends its gradients, every stage at once when its backward is done, and
              sums all pods' gradients in pod order, so all pods hold bitwise-equal parameters.
  overlapped  the same sum, but each pod's model is cut into `exchange.buckets` chunks that are
              differentiated one after another, and a chunk's gradients are sent as soon as it
              is done, so the transfer overlaps the backward of the chunks before it.
  stale       one-step staleness: step t applies the all-pod gradient sum of step t-1 (computed
              at the parameters of step t-1), so the exchange has a whole step to complete. The
              first step has nothing to apply and leaves parameters and optimizer state as they
              are. Pods stay identical. Numerics: after step t+1 the parameters equal the sync
              run's after step t (same batches, constant learning rate).
  diloco      DiLoCo (Douillard et al., 2023): pods take `exchange.inner_steps` optimizer steps
              on their own gradients alone; then each sends its parameter delta since the last
              outer step, all average the deltas in pod order and step the shared anchor with
              SGD + Nesterov momentum (`exchange.outer_lr`, `exchange.outer_momentum`), and set
              their parameters to it. Pods are identical after each outer step; their inner
              optimizer states stay their own (so checkpoints hold every pod's state).
Compression applies to what is sent; every pod sums the decoded values, its own included, so the
pods stay identical under compression too. With error feedback, what a step's encoding lost is
added to the next step's gradients before encoding, so nothing is lost for good (the residuals
differ per pod, so checkpoints then hold every pod's state).
"""

import jax
import jax.numpy as jnp
import optax

from pwtrain.models import moe as moe_lib
from pwtrain.step import STAT_KEYS

MODES = ("sync", "overlapped", "stale", "diloco")
COMPRESSIONS = ("none", "bf16", "int8")


def encode(tree, compression: str):
  if compression == "none":
    return tree
  if compression == "bf16":
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
  assert compression == "int8"
  return jax.tree.map(_int8_encode, tree)


def decode(tree, compression: str):
  if compression == "none":
    return tree
  if compression == "bf16":
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  return jax.tree.map(
    lambda e: e["q"].astype(jnp.float32) * e["scale"],
    tree,
    is_leaf=lambda x: isinstance(x, dict) and set(x) == {"q", "scale"},
  )


def _int8_encode(x):
  """Symmetric int8 with one scale per chunk; a chunk is a row along the last dim, so the
  array's sharding over its other dims is kept."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
  scale = jnp.where(scale == 0, 1.0, scale)
  return {"q": jnp.round(x / scale).astype(jnp.int8), "scale": scale}


def encode_with_feedback(grads, residual, compression: str):
  """Encodes grads + residual; returns (encoded, new residual = what the encoding lost)."""
  target = jax.tree.map(jnp.add, grads, residual)
  encoded = encode(target, compression)
  return encoded, jax.tree.map(jnp.subtract, target, decode(encoded, compression))


def encoded_bytes(abstract_tree, compression: str) -> int:
  out = jax.eval_shape(lambda t: encode(t, compression), abstract_tree)
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))


def init_pending(params, num_experts: int = 0) -> dict:
  """The stale exchange's carried state: last step's summed gradients, stats and squared norm."""
  return {
    "grads": jax.tree.map(jnp.zeros_like, params),
    "stats": {k: jnp.zeros((), jnp.float32) for k in STAT_KEYS} | moe_lib.zero_stats(num_experts),
    "sumsq": jnp.zeros((), jnp.float32),
  }


def stale(update):
  """Wraps a (state, grads, stats, sumsq) -> (state, metrics) update to apply last step's sum.

  The metrics describe the current step (its loss and gradient norm); the update applied is the
  previous step's.
  """

  def fn(state, grads, stats, sumsq):
    pending = state["pending"]
    base = {k: v for k, v in state.items() if k != "pending"}
    new, _ = update(base, pending["grads"], pending["stats"], pending["sumsq"])
    ready = pending["stats"]["tokens"] > 0
    for key in ("params", "opt_state"):
      new[key] = jax.tree.map(lambda a, b: jnp.where(ready, a, b), new[key], base[key])
    new["pending"] = {"grads": grads, "stats": stats, "sumsq": sumsq}
    # Metrics of the current step; XLA drops the rest of this second update as dead code.
    _, metrics = update(base, grads, stats, sumsq)
    return new, metrics

  return fn


def outer_optimizer(exchange_cfg) -> optax.GradientTransformation:
  return optax.sgd(exchange_cfg.outer_lr, momentum=exchange_cfg.outer_momentum, nesterov=True)


def init_outer(params, outer_tx) -> dict:
  """DiLoCo's carried state: the anchor (parameters after the last outer step), its optimizer."""
  return {"anchor": params, "opt_state": outer_tx.init(params)}


def outer_delta(state):
  """The pseudo-gradient: how far the inner steps moved the parameters from the anchor."""
  return jax.tree.map(jnp.subtract, state["outer"]["anchor"], state["params"])


def outer_update(state, deltas: list, outer_tx) -> dict:
  mean = deltas[0]
  for d in deltas[1:]:
    mean = jax.tree.map(jnp.add, mean, d)
  mean = jax.tree.map(lambda x: x / len(deltas), mean)
  outer = state["outer"]
  updates, opt_state = outer_tx.update(mean, outer["opt_state"], outer["anchor"])
  anchor = optax.apply_updates(outer["anchor"], updates)
  return {**state, "params": anchor, "outer": {"anchor": anchor, "opt_state": opt_state}}
