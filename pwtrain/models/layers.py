"""Building blocks of the PaLM decoder: bias-free LayerNorm, RoPE, MQA attention, SwiGLU (or a
sparse MoE FFN, pwtrain.models.moe).

Parameters carry logical axis names in their `axes` metadata; nothing here knows about meshes.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from pwtrain.models.moe import MoE
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


def rope(x, positions, base: float):
  """Rotary position embedding over the last dim of x [batch, length, heads, head_dim]."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [b, l, 1, half]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


ATTENTION = ("einsum", "xla", "cudnn")


def causal_attention(q, k, v, implementation: str):
  """Causal softmax(q k^T / sqrt(head_dim)) v; q [b, l, h, d], k and v [b, l, g, d] with g
  dividing h (query heads share K/V heads in groups: MQA for g = 1, GQA otherwise).

  "einsum": `attend`, logits and softmax in float32; "xla" and "cudnn":
  `jax.nn.dot_product_attention` with that implementation (cudnn: fused attention on NVIDIA
  GPUs, bf16/fp16 only).
  """
  if implementation != "einsum":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  return attend(q, k, v)


def attend(q, k, v, mask=None):
  """softmax(q k^T / sqrt(head_dim)) v over the keys `mask` allows; q [b, l, h, d], k and v
  [b, m, g, d] with g dividing h. `mask` (True: attend) broadcasts to [b, g, h/g, l, m], e.g.
  [b, 1, 1, l, m]; None is causal (l == m, query i sees keys 0..i). Logits and softmax in
  float32; masked keys get weight exactly 0."""
  b, length, h, d = q.shape
  g = k.shape[2]
  # Query heads are grouped onto their shared K/V head: [b, l, g, h/g, d].
  q = q.reshape(b, length, g, h // g, d) * (d**-0.5)
  logits = jnp.einsum("blgrk,bmgk->bgrlm", q, k).astype(jnp.float32)
  if mask is None:
    mask = jnp.tril(jnp.ones((length, length), dtype=bool))
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  return jnp.einsum("bgrlm,bmgk->blgrk", probs, v).reshape(b, length, h, d)


class Attention(nnx.Module):
  """Causal multi-query (num_kv_heads=1) or grouped-query attention with RoPE."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype):
    d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = h, g, k
    self.rope_base = cfg.rope_base
    self.implementation = cfg.get("attention", "einsum")

    def param(shape, names, init):
      return nnx.Param(init(rngs.params(), shape, param_dtype), axes=names)

    self.wq = param((d, h, k), ("embed", "heads", "head_dim"), fan_in_init(0, (1, 2)))
    self.wk = param((d, g, k), ("embed", "kv_heads", "head_dim"), fan_in_init(0, (1, 2)))
    self.wv = param((d, g, k), ("embed", "kv_heads", "head_dim"), fan_in_init(0, (1, 2)))
    self.wo = param((h, k, d), ("heads", "head_dim", "embed"), fan_in_init((0, 1), 2))

  def __call__(self, x, positions):
    q, kk, v = self.project(x, positions)
    out = causal_attention(q, kk, v, self.implementation)
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
    q = constrain(rope(q, positions, self.rope_base), ("batch", "length", "heads", "head_dim"))
    return q, rope(kk, positions, self.rope_base), v

  def output(self, out):
    """The heads' outputs [b, l, h, k] -> [b, l, d]."""
    return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(out.dtype))


class SwiGLU(nnx.Module):
  """PaLM's MLP: (swish(x W_gate) * (x W_up)) W_down, no biases.

  The matmuls run on the tokens flattened to rows, [b * l, d] @ [d, f] (the same products as
  on [b, l, d]), so that a weight's gradient is a matmul contracting one dimension. Contracting
  (batch, length), XLA:CPU first transposed the [b, l, f] cotangent in a loop fusion: 33 ms
  instead of 9 for one such gradient at d_model 256, d_ff 1024, 4096 tokens, and that fusion
  was up to 9x slower again in a scanned model, where it also slices the stacked residuals
  (models/scan.py).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype):
    d, f = cfg.d_model, cfg.d_ff

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
    hidden = (jax.nn.silu(gate) * up).reshape(*shape[:-1], -1)
    hidden = checkpoint_name(constrain(hidden, ("batch", "length", "mlp")), "mlp")
    out = hidden.reshape(rows.shape[0], -1) @ self.w_down[...].astype(dtype)
    return out.reshape(shape)


class ParallelBlock(nnx.Module):
  """PaLM's parallel formulation: y = x + MLP(LN(x)) + Attention(LN(x)), one shared LN.

  With `moe` (the moe config) the MLP is a sparse MoE FFN (attribute `moe` instead of `mlp`).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, moe=None):
    self.norm = LayerNorm(cfg.d_model, param_dtype=param_dtype)
    self.attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype)
    self.is_moe = moe is not None
    if moe is None:
      self.mlp = SwiGLU(cfg, rngs=rngs, param_dtype=param_dtype)
    else:
      self.moe = MoE(cfg, moe, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, x, positions):
    return self.with_stats(x, positions, train=False)[0]

  def with_stats(self, x, positions, *, train: bool, rngs=None):
    """-> (y, MoE stats of this block: {} for a dense block). See PaLM.forward for the args."""
    h = self.norm(x)
    attn = self.attn(h, positions)  # traced first, as before MoE: the dense HLO is unchanged
    if self.is_moe:
      ffn, stats = self.moe(h, train=train, rngs=rngs)
    else:
      ffn, stats = self.mlp(h), {}
    y = x + attn + ffn
    return constrain(y, ("batch", "length", "embed")), stats
