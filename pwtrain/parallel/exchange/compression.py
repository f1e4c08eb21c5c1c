"""What crosses pods, encoded: `none`, `bf16`, or `int8` with one scale per row.

Every pod sums the decoded values, its own included, so the pods stay identical under
compression. With error feedback, what a step's encoding lost is added to the next step's
gradients before encoding, so nothing is lost for good.
"""

import jax
import jax.numpy as jnp

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


def tree_sum(trees: list):
  """The sum of same-shaped trees, added in list order (pod order: bitwise equal everywhere)."""
  total = trees[0]
  for tree in trees[1:]:
    total = jax.tree.map(jnp.add, total, tree)
  return total
