"""The decoder's forward pass with a key/value cache, for autoregressive decoding.

`forward` runs a PaLM module's own blocks (models/blocks.py, of whichever family) and its
embedding and head on new tokens at given positions, each block's attention writing its keys
and values into a `KVCache` and attending to every cached position up to the query's own (and
within the layer's sliding window). Its arithmetic is the training forward's (the block's
`with_stats` with layers.Attention's `project` and `output`, layers.attend), except that softmax
runs over the cache's `max_len` keys (the masked ones with weight exactly 0) instead of the
sequence's, so its logits equal `PaLM.__call__`'s up to float rounding; it is the written-out
attention whatever `model.attention` says, "invariant"'s where it says so, and then its logits
equal the forward's bitwise on XLA:CPU (layers.attend; docs/rl.md). The training path is
untouched by this module.

The cache is MQA-sized: per layer, keys and values of shape [batch, max_len, num_kv_heads,
head_dim], one K/V head (PaLM's multi-query attention) or `num_kv_heads` of them (grouped-query).
A scanned model (models/scan.py) has them stacked as its parameters are: per position of the
period, [num_periods, batch, max_len, num_kv_heads, head_dim], and its decode scans the periods.

Positions. Row b's token j goes to cache position `positions[b, j]` and attends to cache
positions 0..positions[b, j]; whatever the cache holds there must be that row's keys and values
(earlier calls'), while positions after it may hold anything (they are masked). So a batch of
prompts of different lengths is prefilled right-padded, each row then decoding from its own
length: the padding's entries are masked until the decoded tokens overwrite them. Every row
has its own positions, so rows at different points of their sequences decode together
(pwtrain/serve's continuous batching), and `rows` lets a call use some rows of a larger cache
(the prefill of one serving slot writes only that slot's row).

Stages. `forward` runs whatever part of the model `model` is: a pipeline stage without the
embedding takes the previous stage's activations instead of tokens, and one without the head
returns its activations, so a decode can run through a pipeline's stages one after another,
each with the cache of its own layers.

MoE layers use the eval path (`train=False`: eval capacity factor, no jitter). A decoded token
is routed in a group of its own (capacity >= 1, so it is never dropped), whereas the full
forward routes it with its whole sequence; where the full forward would drop it the two differ.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pwtrain.models import scan as scan_lib
from pwtrain.models.palm import PaLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per layer (model order), keys and values [batch, max_len, num_kv_heads, head_dim]; for a
  scanned model per position of the period, [num_periods, batch, max_len, ...]."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[-3]


def init_cache(model: PaLM, batch: int, max_len: int) -> KVCache:
  """Zeros for `batch` rows of `max_len` positions, in the model's activation dtype, for the
  model's (or the stage's) layers."""
  blocks = model.layers if model.scan else model.blocks
  lead = (scan_lib.num_periods(model.layers),) if model.scan else ()
  zeros = tuple(
    jnp.zeros((*lead, batch, max_len, b.attn.num_kv_heads, b.attn.head_dim), model.dtype)
    for b in blocks
  )
  return KVCache(k=zeros, v=zeros)


def forward(model: PaLM, cache: KVCache, inputs, positions, *, rows=None, logits_at=None):
  """Inputs [b, l] at `positions` [b, l] (int32, each row increasing) -> (out, new cache).

  `inputs` are token ids, or for a stage without the embedding the previous stage's
  activations [b, l, d_model]. `out` is, for a model with the head, the logits (float32)
  [b, l, vocab], or with `logits_at` ([b] int32 indices into l) only those of token
  logits_at[b] of each row, [b, vocab]; for a stage without it, its activations [b, l,
  d_model]. `rows` ([b] int32): the cache rows that the batch's rows use (default: row b is
  cache row b, and the cache has b rows). See the module docstring for what the cache must hold.
  """
  x = model.embed(inputs) if model.has_embed else inputs.astype(model.dtype)
  where = (rows, positions)
  if model.scan:
    x, new_k, new_v = _scanned(model.layers, x, where, cache)
  else:
    new_k, new_v = [], []
    for block, k_cache, v_cache in zip(model.blocks, cache.k, cache.v, strict=True):
      x, k_cache, v_cache = _block(block, x, where, k_cache, v_cache)
      new_k.append(k_cache)
      new_v.append(v_cache)
  new_cache = KVCache(k=tuple(new_k), v=tuple(new_v))
  if not model.has_head:
    return x, new_cache
  if logits_at is not None:
    x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [b, 1, d]
  logits = model.head(x)
  if logits_at is not None:
    logits = logits[:, 0]
  return logits, new_cache


def _scanned(layers, x, where, cache: KVCache):
  """The stacked blocks over the periods (jax.lax.scan), each period's caches in and out."""
  splits = [nnx.split(block) for block in layers]

  def body(x, xs):
    states, k_caches, v_caches = xs
    new_k, new_v = [], []
    for (graphdef, _), state, k_cache, v_cache in zip(
      splits, states, k_caches, v_caches, strict=True
    ):
      block = nnx.merge(graphdef, state)
      x, k_cache, v_cache = _block(block, x, where, k_cache, v_cache)
      new_k.append(k_cache)
      new_v.append(v_cache)
    return x, (tuple(new_k), tuple(new_v))

  states = [state for _, state in splits]
  x, (new_k, new_v) = jax.lax.scan(body, x, (states, cache.k, cache.v))
  return x, new_k, new_v


def _block(block, x, where, k_cache, v_cache):
  """The block (models/blocks.py) with cached attention: its keys and values written into the
  caches at `where` ((cache rows or None, positions)), its queries attending over those rows.
  -> (y, new k cache, new v cache)."""
  rows, positions = where
  written = {}

  def core(attn, q, k, v):
    written["k"] = _write(k_cache, k, rows, positions)
    written["v"] = _write(v_cache, v, rows, positions)
    k_seen, v_seen = written["k"], written["v"]
    if rows is not None:
      k_seen, v_seen = k_seen[rows], v_seen[rows]
    return attn.attend_cached(q, k_seen, v_seen, positions)

  y, _ = block.with_stats(x, positions, train=False, core=core)
  return y, written["k"], written["v"]


def _write(cache, new, rows, positions):
  """cache [B, max_len, g, k] with new [b, l, g, k] written at positions [b, l] of cache rows
  `rows` [b] (None: rows 0..b-1, b == B)."""
  rows = jnp.arange(cache.shape[0]) if rows is None else rows
  return cache.at[rows[:, None], positions].set(new.astype(cache.dtype))
