"""What crosses pods: gradient compression and the exchange modes.

Pods (data-parallel replicas on separate islands) each compute gradients of their share of the
global batch; the exchange makes every pod apply the same update, PaLM-style:
  sync        each pod sends its gradients, every stage at once when its backward is done, and
              sums all pods' gradients in pod order, so all pods hold bitwise-equal parameters.
  overlapped  the same sum, but each pod's model is cut into `exchange.buckets` chunks that are
              differentiated one after another, and a chunk's gradients are sent as soon as it
              is done, so the transfer overlaps the backward of the chunks before it.
Compression applies to what is sent; every pod sums the decoded values, its own included, so the
pods stay identical under compression too.
"""

import jax
import jax.numpy as jnp

MODES = ("sync", "overlapped")
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


def encoded_bytes(abstract_tree, compression: str) -> int:
  out = jax.eval_shape(lambda t: encode(t, compression), abstract_tree)
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))
