"""Building blocks of the decoder: norms, RoPE, attention (multi-query or grouped-query), the
gated MLP. What each family takes of them is models/family.py's record; the blocks that put
them together are models/blocks.py.

Parameters carry logical axis names in their `axes` metadata; nothing here knows about meshes.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from pwtrain.models import family as family_lib
from pwtrain.sharding import constrain


# PaLM initialises kernels with variance 1/fan_in. in_axis/out_axis say which dims are fan-in
# for the multi-dimensional (heads, head_dim) kernels.
def fan_in_init(in_axis, out_axis):
  return nnx.initializers.variance_scaling(
    1.0, "fan_in", "normal", in_axis=in_axis, out_axis=out_axis
  )


class LayerNorm(nnx.Module):
  """LayerNorm with a scale and no bias (PaLM: no biases anywhere)."""

  def __init__(self, dim: int, *, param_dtype, eps: float = 1e-6):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("norm",))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) (in float32) times a scale: Llama's, `scale * y.astype(x.dtype)`; with
  `plus_one` Gemma's, `(y * (1 + scale)).astype(x.dtype)`, its scale starting at 0."""

  def __init__(self, dim: int, *, param_dtype, eps: float, plus_one: bool = False):
    self.eps, self.plus_one = eps, plus_one
    init = jnp.zeros if plus_one else jnp.ones
    self.scale = nnx.Param(init((dim,), param_dtype), axes=("norm",))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def make_norm(family: family_lib.Family, dim: int, *, param_dtype):
  """The family's norm over the last `dim` entries."""
  if family.norm == "layernorm":
    return LayerNorm(dim, param_dtype=param_dtype, eps=family.norm_eps)
  plus_one = family.norm == "rmsnorm_plus_one"
  return RMSNorm(dim, param_dtype=param_dtype, eps=family.norm_eps, plus_one=plus_one)


def rope(x, positions, base: float):
  """PaLM's rotary position embedding over the last dim of x [batch, length, heads, head_dim]:
  frequencies base^(-i / (head_dim / 2))."""
  half = x.shape[-1] // 2
  return rotate(x, positions, base ** (-jnp.arange(half, dtype=jnp.float32) / half))


def rotate(x, positions, inv_freq):
  """Rotates the pairs (x[i], x[i + head_dim/2]) of each head by positions * inv_freq[i]
  (float32 [head_dim / 2]); Hugging Face's `rotate_half` layout."""
  angle = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # [b, l, 1, half]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


WRITTEN_OUT = family_lib.WRITTEN_OUT  # `attend`'s: the KV-cache decoder's too
ATTENTION = (*WRITTEN_OUT, "xla", "cudnn")


def causal_attention(q, k, v, implementation: str, *, scale=None, softcap=0.0, window=0):
  """Causal softmax(q k^T scale) v; q [b, l, h, d], k and v [b, l, g, d] with g dividing h
  (query heads share K/V heads in groups: MQA for g = 1, GQA otherwise); `scale` None is
  d^-1/2; `softcap` > 0 caps the logits at +-softcap (tanh); `window` > 0 lets query i see keys
  i - window < j <= i only.

  "einsum" and "invariant": `attend` (its `invariant` the latter), logits and softmax in
  float32; "xla" and "cudnn": `jax.nn.dot_product_attention` with that implementation (cudnn:
  fused attention on NVIDIA GPUs, bf16/fp16 only; no soft cap).
  """
  if implementation not in WRITTEN_OUT:
    local = (window - 1, 0) if window else None
    return jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation=implementation
    )
  mask = None if not window else window_mask(jnp.arange(q.shape[1])[None], q.shape[1], window)
  invariant = implementation == "invariant"
  return attend(q, k, v, mask, scale=scale, softcap=softcap, invariant=invariant)


def window_mask(positions, num_keys: int, window: int = 0):
  """[b, 1, 1, l, num_keys] (broadcast over K/V heads and the query heads of each): the query at
  positions [b, l] sees keys 0..position, and with `window` only the last `window` of them."""
  keys = jnp.arange(num_keys)[None, None, :]
  mask = keys <= positions[:, :, None]
  if window:
    mask &= keys > positions[:, :, None] - window
  return mask[:, None, None]


def attend(q, k, v, mask=None, *, scale=None, softcap=0.0, invariant=False):
  """softmax(q k^T scale) v over the keys `mask` allows; q [b, l, h, d], k and v [b, m, g, d]
  with g dividing h. `scale` None is d^-1/2; `softcap` > 0 maps the logits to softcap *
  tanh(logits / softcap) before the mask. `mask` (True: attend) broadcasts to
  [b, g, h/g, l, m], e.g. [b, 1, 1, l, m]; None is causal (l == m, query i sees keys 0..i).
  Logits and softmax in float32; masked keys get weight exactly 0.

  `invariant`: q k^T and p v as elementwise products summed by reductions (over d, and over
  the m keys) instead of dot products, so that a query's output does not depend on how many
  queries are computed with it, nor on masked keys after its own (each adds an exact 0): a
  dot's kernel sums in an order of its own for a matrix-vector product (the KV-cache decode's
  one query per row) and for a matrix product (the training forward's sequence of queries).
  Under XLA:CPU's own reduction emitters (platforms.CPU_NUMERICS_FLAG) the decode's logits then
  equal the forward pass's bitwise (docs/rl.md). The products and their sums are float32
  whatever q's dtype (the output then cast to it). Its products and sums use no matrix units,
  and are [b, g, h/g, l, m, d] before their reductions (d times the logits') wherever XLA does
  not fuse them into the reduction.
  """
  b, length, h, d = q.shape
  g = k.shape[2]
  # Query heads are grouped onto their shared K/V head: [b, l, g, h/g, d].
  q = q.reshape(b, length, g, h // g, d) * (d**-0.5 if scale is None else scale)
  f32 = jnp.float32
  if invariant:  # [b, g, h/g, l, 1, d] * [b, g, 1, 1, m, d] in float32, summed over d
    # q through a product with the identity (exact): XLA:CPU keeps a dot's output, where it
    # fuses q's producers (RoPE's sin and cos) into the reduction, computing them per key.
    # HIGHEST: at the default precision a TPU multiplies float32 in bfloat16 passes, which
    # would round q.
    q = jnp.einsum("blgrk,kj->blgrj", q, jnp.eye(d, dtype=q.dtype), precision="highest")
    keys = k.transpose(0, 2, 1, 3)[:, :, None, None].astype(f32)
    logits = jnp.sum(q.transpose(0, 2, 3, 1, 4)[:, :, :, :, None].astype(f32) * keys, axis=-1)
  else:
    logits = jnp.einsum("blgrk,bmgk->bgrlm", q, k).astype(f32)
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  if mask is None:
    mask = jnp.tril(jnp.ones((length, length), dtype=bool))
  logits = jnp.where(mask, logits, jnp.finfo(f32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  if invariant:  # [b, g, h/g, l, m, 1] * [b, g, 1, 1, m, d] in float32, summed over m
    values = v.transpose(0, 2, 1, 3)[:, :, None, None].astype(f32)
    out = jnp.sum(probs[..., None] * values, axis=-2).transpose(0, 3, 1, 2, 4).astype(q.dtype)
  else:
    out = jnp.einsum("bgrlm,bmgk->blgrk", probs.astype(q.dtype), v)
  return out.reshape(b, length, h, d)


class Attention(nnx.Module):
  """Causal multi-query (num_kv_heads=1) or grouped-query attention with RoPE, and the family's
  options: q/k/v biases, per-head q/k RMSNorm, the query scale, a logit soft cap and this
  layer's sliding `window` (0: global)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, window: int = 0):
    d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    family = family_lib.of(cfg)
    self.num_heads, self.num_kv_heads, self.head_dim = h, g, k
    self.rope_base = cfg.rope_base
    # Hugging Face's frequencies as plain floats (a static attribute); None: PaLM's.
    self.inv_freq = None
    if family.hf_rope:
      self.inv_freq = tuple(map(float, family_lib.inverse_frequencies(cfg)))
    self.implementation = cfg.get("attention", "einsum")
    self.window, self.softcap = window, family.attn_softcap
    self.scale = None if family.query_scale_dim == k else family.query_scale_dim**-0.5

    def param(shape, names, init):
      return nnx.Param(init(rngs.params(), shape, param_dtype), axes=names)

    self.wq = param((d, h, k), ("embed", "heads", "head_dim"), fan_in_init(0, (1, 2)))
    self.wk = param((d, g, k), ("embed", "kv_heads", "head_dim"), fan_in_init(0, (1, 2)))
    self.wv = param((d, g, k), ("embed", "kv_heads", "head_dim"), fan_in_init(0, (1, 2)))
    self.wo = param((h, k, d), ("heads", "head_dim", "embed"), fan_in_init((0, 1), 2))
    self.has_bias, self.has_qk_norm = family.qkv_bias, family.qk_norm
    if family.qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq = param((h, k), ("heads", "head_dim"), zeros)
      self.bk = param((g, k), ("kv_heads", "head_dim"), zeros)
      self.bv = param((g, k), ("kv_heads", "head_dim"), zeros)
    if family.qk_norm:
      self.q_norm = RMSNorm(k, param_dtype=param_dtype, eps=family.norm_eps)
      self.k_norm = RMSNorm(k, param_dtype=param_dtype, eps=family.norm_eps)

  def __call__(self, x, positions, core=None):
    """x [b, l, d] at `positions` [b, l] -> [b, l, d]. `core(self, q, k, v)`, when given,
    attends in place of causal attention over the sequence (the KV-cache decoder's)."""
    q, kk, v = self.project(x, positions)
    if core is None:
      out = causal_attention(
        q, kk, v, self.implementation, scale=self.scale, softcap=self.softcap, window=self.window
      )
    else:
      out = core(self, q, kk, v)
    # Named for the remat policy that keeps only the attention and MLP outputs (models/remat.py).
    out = checkpoint_name(constrain(out, ("batch", "length", "heads", "head_dim")), "attention")
    return self.output(out)

  def project(self, x, positions):
    """x [b, l, d] at `positions` [b, l] -> (q [b, l, h, k], k [b, l, g, k], v [b, l, g, k]),
    RoPE applied to q and k. The KV-cache decoder (models/decode.py) caches k and v."""
    dtype = x.dtype
    q = jnp.einsum("bld,dhk->blhk", x, self.wq[...].astype(dtype))
    kk = jnp.einsum("bld,dgk->blgk", x, self.wk[...].astype(dtype))
    v = jnp.einsum("bld,dgk->blgk", x, self.wv[...].astype(dtype))
    if self.has_bias:
      q, kk, v = (a + b[...].astype(dtype) for a, b in ((q, self.bq), (kk, self.bk), (v, self.bv)))
    if self.has_qk_norm:
      q, kk = self.q_norm(q), self.k_norm(kk)
    q = constrain(self.rope(q, positions), ("batch", "length", "heads", "head_dim"))
    return q, self.rope(kk, positions), v

  def rope(self, x, positions):
    if self.inv_freq is None:
      return rope(x, positions, self.rope_base)
    return rotate(x, positions, jnp.asarray(self.inv_freq, jnp.float32))

  def attend_cached(self, q, k_cache, v_cache, positions):
    """q [b, l, h, k] at `positions` [b, l] over a cache's keys and values [b, max_len, g, k]:
    each query sees the cache positions up to its own (and within this layer's window). The
    written-out attention: `attend`, invariant when model.attention is "invariant"."""
    mask = window_mask(positions, k_cache.shape[1], self.window)
    invariant = self.implementation == "invariant"
    return attend(
      q, k_cache, v_cache, mask, scale=self.scale, softcap=self.softcap, invariant=invariant
    )

  def output(self, out):
    """The heads' outputs [b, l, h, k] -> [b, l, d]."""
    return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(out.dtype))


# model.activation's functions: "gelu" is the exact GELU (erf), "gelu_tanh" its tanh approximation.
ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class GatedMLP(nnx.Module):
  """The gated MLP: (act(x W_gate) * (x W_up)) W_down, no biases; act is silu (SwiGLU: PaLM,
  Llama) or gelu (GeGLU: Gemma, tanh-approximated unless model.activation says "gelu").

  The matmuls run on the tokens flattened to rows, [b * l, d] @ [d, f] (the same products as
  on [b, l, d]), so that a weight's gradient is a matmul contracting one dimension. Contracting
  (batch, length), XLA:CPU first transposed the [b, l, f] cotangent in a loop fusion: 33 ms
  instead of 9 for one such gradient at d_model 256, d_ff 1024, 4096 tokens, and that fusion
  was up to 9x slower again in a scanned model, where it also slices the stacked residuals
  (models/scan.py).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, activation: str = "silu"):
    d, f = cfg.d_model, cfg.d_ff
    self.activation = activation

    def param(shape, names):
      return nnx.Param(fan_in_init(0, 1)(rngs.params(), shape, param_dtype), axes=names)

    self.w_gate = param((d, f), ("embed", "mlp"))
    self.w_up = param((d, f), ("embed", "mlp"))
    self.w_down = param((f, d), ("mlp", "embed"))

  def __call__(self, x):
    dtype, shape = x.dtype, x.shape
    rows = x.reshape(-1, shape[-1])  # [b * l, d]
    gate = rows @ self.w_gate[...].astype(dtype)
    up = rows @ self.w_up[...].astype(dtype)
    hidden = (ACTIVATIONS[self.activation](gate) * up).reshape(*shape[:-1], -1)
    hidden = checkpoint_name(constrain(hidden, ("batch", "length", "mlp")), "mlp")
    out = hidden.reshape(rows.shape[0], -1) @ self.w_down[...].astype(dtype)
    return out.reshape(shape)
