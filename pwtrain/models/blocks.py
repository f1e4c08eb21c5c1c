"""The decoder's blocks: PaLM's parallel block and the sequential (pre-norm) block of Llama and
Gemma, each with a dense gated MLP or a sparse MoE FFN (models/moe.py).

Both have one interface: `with_stats(x, positions, train=..., rngs=..., core=...)` -> (y, the
block's MoE stats: {} for a dense block), where `core` replaces causal attention over the
sequence (the KV-cache decoder's, models/decode.py); `is_moe`; `attn`; and `mlp` or `moe`.
"""

from flax import nnx

from pwtrain.models import family as family_lib
from pwtrain.models.layers import Attention, GatedMLP, make_norm
from pwtrain.models.moe import MoE
from pwtrain.sharding import constrain

ACT = ("batch", "length", "embed")


def make_block(cfg, *, rngs: nnx.Rngs, param_dtype, moe=None, layer: int = 0):
  """Layer `layer` (global index: its sliding window depends on it) of the family's block; with
  `moe` (the moe config) its FFN is a sparse MoE FFN."""
  family = family_lib.of(cfg)
  block = ParallelBlock if family.parallel_block else SequentialBlock
  window = family.window(layer)
  return block(cfg, family, rngs=rngs, param_dtype=param_dtype, moe=moe, window=window)


def _ffn(block, cfg, family, moe, *, rngs, param_dtype):
  block.is_moe = moe is not None
  if moe is None:
    block.mlp = GatedMLP(cfg, rngs=rngs, param_dtype=param_dtype, activation=family.activation)
  else:
    block.moe = MoE(cfg, moe, rngs=rngs, param_dtype=param_dtype, activation=family.activation)


def _apply_ffn(block, h, *, train, rngs):
  if block.is_moe:
    return block.moe(h, train=train, rngs=rngs)
  return block.mlp(h), {}


class ParallelBlock(nnx.Module):
  """PaLM's parallel formulation: y = x + MLP(LN(x)) + Attention(LN(x)), one shared LN.

  With `moe` (the moe config) the MLP is a sparse MoE FFN (attribute `moe` instead of `mlp`).
  """

  def __init__(self, cfg, family, *, rngs: nnx.Rngs, param_dtype, moe=None, window: int = 0):
    self.norm = make_norm(family, cfg.d_model, param_dtype=param_dtype)
    self.attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype, window=window)
    _ffn(self, cfg, family, moe, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, x, positions):
    return self.with_stats(x, positions, train=False)[0]

  def with_stats(self, x, positions, *, train: bool, rngs=None, core=None):
    """-> (y, MoE stats of this block: {} for a dense block). See PaLM.forward for the args."""
    h = self.norm(x)
    attn = self.attn(h, positions, core)  # traced first, as before MoE: the dense HLO is unchanged
    ffn, stats = _apply_ffn(self, h, train=train, rngs=rngs)
    y = x + attn + ffn
    return constrain(y, ACT), stats


class SequentialBlock(nnx.Module):
  """The pre-norm block of Llama and Gemma: x = x + Attention(N1(x)), y = x + MLP(N2(x)); with
  the family's post-norms (Gemma 2) each branch's output is normed again before it is added:
  x + P1(Attention(N1(x))), x + P2(MLP(N2(x)))."""

  def __init__(self, cfg, family, *, rngs: nnx.Rngs, param_dtype, moe=None, window: int = 0):
    norm = lambda: make_norm(family, cfg.d_model, param_dtype=param_dtype)
    self.attn_norm = norm()
    self.attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype, window=window)
    self.mlp_norm = norm()
    _ffn(self, cfg, family, moe, rngs=rngs, param_dtype=param_dtype)
    self.post_norms = family.post_norms
    if family.post_norms:
      self.post_attn_norm, self.post_mlp_norm = norm(), norm()

  def __call__(self, x, positions):
    return self.with_stats(x, positions, train=False)[0]

  def with_stats(self, x, positions, *, train: bool, rngs=None, core=None):
    """-> (y, MoE stats of this block: {} for a dense block). See PaLM.forward for the args."""
    attn = self.attn(self.attn_norm(x), positions, core)
    if self.post_norms:
      attn = self.post_attn_norm(attn)
    x = constrain(x + attn, ACT)
    ffn, stats = _apply_ffn(self, self.mlp_norm(x), train=train, rngs=rngs)
    if self.post_norms:
      ffn = self.post_mlp_norm(ffn)
    return constrain(x + ffn, ACT), stats
