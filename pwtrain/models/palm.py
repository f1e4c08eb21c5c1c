"""The decoder as a Flax NNX module, sliceable into stages: PaLM's (Chowdhery et al., 2022),
and every other family's (`model.family`, models/family.py), whose choices it reads.

A pipeline stage is `embed` (first stage only) + `blocks[start:stop]` + `head` (last stage only);
`__call__` is the whole model. PaLM's output layer shares the input embedding and scales logits
by 1/sqrt(d_model); Gemma's shares it unscaled (and scales the embeddings by sqrt(d_model));
Llama's is its own matrix, `unembedding` [d_model, vocab], unless model.tie_embeddings. The loss
adds PaLM's z-loss, model.z_loss * log(Z)^2, to keep the softmax normaliser near 1.

With a moe config, every `moe.every`-th layer (by global layer index, so a stage knows its
MoE layers from its `layer_offset`) has a sparse MoE FFN; `forward` returns its summed stats.
With `model.scan_layers` the blocks are held stacked (`layers`) and run with a scan
(models/scan.py): the same parameters, stacked, and the same function.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from pwtrain.models import family as family_lib
from pwtrain.models import moe as moe_lib
from pwtrain.models import remat as remat_lib
from pwtrain.models import scan as scan_lib
from pwtrain.models.blocks import make_block
from pwtrain.models.layers import fan_in_init, make_norm
from pwtrain.sharding import constrain


class PaLM(nnx.Module):
  """The decoder, or one pipeline stage of it.

  A stage has `num_layers` blocks (numbered from 0 within the stage), the embedding lookup if it
  is the first (`has_embed`) and the final norm plus output layer if it is the last
  (`has_head`); with a tied output layer both ends hold the shared embedding matrix. Its block
  k is the model's layer `layer_offset + k`. Scanned (`cfg.scan_layers`), its blocks are
  `layers` instead of `blocks`: one stacked block per position of the period (models/scan.py).
  """

  def __init__(
    self,
    cfg,
    *,
    rngs: nnx.Rngs,
    num_layers: int | None = None,
    has_embed: bool = True,
    has_head: bool = True,
    moe=None,
    layer_offset: int = 0,
  ):
    param_dtype = jnp.dtype(cfg.param_dtype)
    self.dtype = jnp.dtype(cfg.dtype)
    self.d_model = cfg.d_model
    self.has_embed, self.has_head = has_embed, has_head
    self.remat = cfg.get("remat", "none")
    self.family = family = family_lib.of(cfg)
    if has_embed or (has_head and family.tied):
      # PaLM: E ~ N(0, 1); the embedding is not followed by a norm, so unit scale is kept.
      # Gemma's is scaled by sqrt(d_model) in the forward: N(0, 1/d_model) has unit scale there.
      init = nnx.initializers.normal(cfg.d_model**-0.5 if family.embed_scale else 1.0)
      self.embedding = nnx.Param(
        init(rngs.params(), (cfg.vocab_size, cfg.d_model), param_dtype), axes=("vocab", "embed")
      )
    num_layers = cfg.num_layers if num_layers is None else num_layers
    self.num_layers = num_layers
    self.num_experts = moe.num_experts if moe_lib.enabled(moe) else 0
    self.scan = bool(cfg.scan_layers)
    if self.scan:
      self.layers = scan_lib.stacked_blocks(
        cfg,
        rngs=rngs,
        num_layers=num_layers,
        moe=moe,
        layer_offset=layer_offset,
        param_dtype=param_dtype,
      )
    else:
      self.blocks = nnx.List(
        [
          make_block(
            cfg,
            rngs=rngs,
            param_dtype=param_dtype,
            moe=moe if moe_lib.is_moe_layer(moe, layer_offset + k) else None,
            layer=layer_offset + k,
          )
          for k in range(num_layers)
        ]
      )
    if has_head:
      self.final_norm = make_norm(family, cfg.d_model, param_dtype=param_dtype)
    if has_head and not family.tied:
      self.unembedding = nnx.Param(
        fan_in_init(0, 1)(rngs.params(), (cfg.d_model, cfg.vocab_size), param_dtype),
        axes=("embed", "vocab"),
      )

  def embed(self, tokens):
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
    if self.family.embed_scale:
      x = x * jnp.asarray(self.d_model**0.5, self.dtype)
    return constrain(x, ("batch", "length", "embed"))

  def blocks_with_stats(self, x, start=0, stop=None, *, train: bool = False, rngs=None):
    """-> (output of blocks[start:stop], their summed MoE stats; {} for a dense model).

    Scanned, start and stop must be period boundaries (models/scan.py)."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    if self.scan:
      return self._scanned(x, positions, start, stop, train=train, rngs=rngs)
    stats = moe_lib.zero_stats(self.num_experts)

    def apply(block, x, rngs):
      return block.with_stats(x, positions, train=train, rngs=rngs)

    if self.remat != "none":  # models/remat.py
      apply = nnx.remat(apply, policy=remat_lib.policy(self.remat))
    for block in self.blocks[start:stop]:
      x, block_stats = apply(block, x, rngs)
      stats = moe_lib.add_stats(stats, block_stats)
    return x, stats

  def _scanned(self, x, positions, start, stop, *, train, rngs):
    n = len(self.layers)  # layers per period
    stop = self.num_layers if stop is None else stop
    if start % n or stop % n:
      raise ValueError(f"blocks [{start}, {stop}) of a scanned model: not whole periods of {n}")
    return scan_lib.run(
      self.layers,
      x,
      positions,
      start // n,
      stop // n,
      train=train,
      rngs=rngs,
      remat=self.remat,
      num_experts=self.num_experts,
    )

  def run_blocks(self, x, start: int = 0, stop: int | None = None):
    return self.blocks_with_stats(x, start, stop)[0]

  def head(self, x):
    x = self.final_norm(x)
    if self.family.tied:
      logits = jnp.einsum("bld,vd->blv", x, self.embedding[...].astype(self.dtype))
    else:
      logits = jnp.einsum("bld,dv->blv", x, self.unembedding[...].astype(self.dtype))
    logits = logits.astype(jnp.float32)
    if self.family.logit_scale:
      logits = logits * (self.d_model**-0.5)
    if self.family.final_softcap:
      cap = self.family.final_softcap
      logits = cap * jnp.tanh(logits / cap)
    return constrain(logits, ("batch", "length", "vocab"))

  def forward(self, x, *, train: bool, rngs=None):
    """Tokens -> (logits, MoE stats) for the whole model; a stage maps its input to its output.

    `train` picks the MoE capacity factor (train or eval) and enables router jitter, drawn from
    `rngs.jitter` (pass rngs only when moe.jitter > 0). The stats are {} for a dense model.
    """
    if self.has_embed:
      x = self.embed(x)
    x, stats = self.blocks_with_stats(x, train=train, rngs=rngs)
    return (self.head(x) if self.has_head else x), stats

  def __call__(self, x):
    """Tokens -> logits (inference: eval capacity, no jitter)."""
    return self.forward(x, train=False)[0]


def lm_loss(logits, targets, *, z_loss: float = 1e-4):
  """Summed (not averaged) token losses, so microbatches and shards can be added up exactly.

  Returns (sum of ce + z-loss over real tokens, {"ce_sum", "z_sum", "tokens"}). A negative target
  (a position no document filled) carries no loss, so every id of every tokenizer, 0 included,
  can be a real target.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  real = targets >= 0
  safe = jnp.where(real, targets, 0)  # a valid index; its logit is weighted out
  target_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
  weights = real.astype(jnp.float32)
  ce = (log_z - target_logit) * weights
  z = z_loss * jnp.square(log_z) * weights
  ce_sum, z_sum = jnp.sum(ce), jnp.sum(z)
  return ce_sum + z_sum, {"ce_sum": ce_sum, "z_sum": z_sum, "tokens": jnp.sum(weights)}
