"""Model families: one decoder, a small record of choices per family.

`model.family` names a preset of the choices below; the keys of `model.*` fill in those that
vary between checkpoints of one family. `of(model_cfg)` gives the whole record, which the
same modules read (layers.py, attention.py, blocks.py, palm.py): a family is not a copy of the
model.

  choice          palm               llama                   gemma
  block           parallel           sequential              sequential
  norm            layernorm          rmsnorm                 rmsnorm_plus_one (scale 1 + w)
  activation      silu (SwiGLU)      silu (SwiGLU)           gelu_tanh (GeGLU)
                  (model.activation, when set, replaces it: "silu", "gelu_tanh" or "gelu")
  embedding       N(0, 1), unscaled  unscaled                x sqrt(d_model)
  output layer    tied, x d^-1/2     model.tie_embeddings    tied
  rope            PaLM's             Hugging Face's (+ model.rope_scaling="llama3")
  attention       model.sliding_window / sliding_window_pattern (llama, gemma);
                  model.qkv_bias, model.qk_norm (llama: Qwen2, Qwen3);
                  model.query_pre_attn_scalar, model.attn_softcap (gemma 2)
  logits          model.final_softcap (gemma 2)
  post-norms      model.post_norms (gemma 2: a norm after attention and after the MLP)

Rope. Both layouts rotate the pairs (x[i], x[i + head_dim/2]) of each head (Hugging Face's
`rotate_half`), so checkpoints convert without permuting q and k; PaLM's frequencies are
base^(-i / (head_dim/2)) computed on the device (its numerics unchanged), the other families'
are Hugging Face's 1 / base^(2i / head_dim) in float32, with Llama 3.1's rescaling when
`model.rope_scaling="llama3"`.

Sliding windows. A local layer's query at position i sees keys j with i - window < j <= i;
with `sliding_window_pattern` n > 0, layer l (from 0) is global when (l + 1) % n == 0 and local
otherwise (Gemma 2: n = 2, the even layers local), with n = 0 every layer is local (Mistral).
"""

import dataclasses
import math

import numpy as np

from pwtrain.errors import ConfigError

# model.attention's written-out implementations (layers.attend), the only ones with a soft cap.
WRITTEN_OUT = ("einsum", "invariant")

FAMILIES = ("palm", "llama", "gemma")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")  # model.activation ("": the family's)
ROPE_SCALING = ("none", "llama3")


@dataclasses.dataclass(frozen=True)
class Family:
  """Every choice the decoder's modules read (see the module docstring)."""

  name: str
  parallel_block: bool  # PaLM: x + attn(norm(x)) + mlp(norm(x)); else sequential
  norm: str  # "layernorm", "rmsnorm" or "rmsnorm_plus_one"
  norm_eps: float
  activation: str  # the MLP gate's: "silu", "gelu_tanh" or "gelu" (exact: erf)
  embed_scale: bool  # embeddings times sqrt(d_model)
  tied: bool  # the output layer is the embedding matrix
  logit_scale: bool  # logits times d_model^-1/2 (PaLM)
  hf_rope: bool  # Hugging Face's rope frequencies (else PaLM's)
  rope_scaling: str  # "none" or "llama3"
  qkv_bias: bool
  qk_norm: bool
  query_scale_dim: int  # queries are scaled by query_scale_dim^-1/2
  attn_softcap: float  # 0: none
  final_softcap: float  # 0: none
  post_norms: bool
  sliding_window: int  # 0: none
  sliding_window_pattern: int

  def window(self, layer: int) -> int:
    """The sliding window of layer `layer` (global index); 0 for a global layer."""
    if not self.sliding_window:
      return 0
    n = self.sliding_window_pattern
    return 0 if n and (layer + 1) % n == 0 else self.sliding_window

  @property
  def window_period(self) -> int:
    """Layers after which the local/global pattern repeats (1: every layer alike)."""
    return self.sliding_window_pattern if self.sliding_window and self.sliding_window_pattern else 1


_PRESETS = {
  "palm": dict(
    parallel_block=True, norm="layernorm", activation="silu", embed_scale=False, logit_scale=True,
    hf_rope=False,
  ),
  "llama": dict(
    parallel_block=False, norm="rmsnorm", activation="silu", embed_scale=False,
    logit_scale=False, hf_rope=True,
  ),
  "gemma": dict(
    parallel_block=False, norm="rmsnorm_plus_one", activation="gelu_tanh", embed_scale=True,
    logit_scale=False, hf_rope=True,
  ),
}  # fmt: skip


def of(m) -> Family:
  """The family record of model config `m` (`model.*`)."""
  name = m.get("family", "palm")
  preset = {**_PRESETS[name], "activation": m.get("activation", "") or _PRESETS[name]["activation"]}
  return Family(
    name=name,
    norm_eps=float(m.get("norm_eps", 1e-6)),
    tied=name != "llama" or bool(m.get("tie_embeddings", False)),
    rope_scaling=m.get("rope_scaling", "none"),
    qkv_bias=bool(m.get("qkv_bias", False)),
    qk_norm=bool(m.get("qk_norm", False)),
    query_scale_dim=int(m.get("query_pre_attn_scalar", 0)) or m.head_dim,
    attn_softcap=float(m.get("attn_softcap", 0.0)),
    final_softcap=float(m.get("final_softcap", 0.0)),
    post_norms=bool(m.get("post_norms", False)),
    sliding_window=int(m.get("sliding_window", 0)),
    sliding_window_pattern=int(m.get("sliding_window_pattern", 0)),
    **preset,
  )


def inverse_frequencies(m) -> np.ndarray:
  """Hugging Face's rope frequencies for model config `m` (float32 [head_dim / 2]): 1 /
  base^(2i / head_dim), rescaled as Llama 3.1 does with model.rope_scaling="llama3"."""
  dim = m.head_dim
  inv = (1.0 / (np.float32(m.rope_base) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(
    np.float32
  )
  if m.get("rope_scaling", "none") != "llama3":
    return inv
  factor, low, high = m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor
  old = m.rope_original_max_len
  wavelen = (2 * math.pi / inv).astype(np.float32)
  scaled = np.where(wavelen > old / low, inv / factor, inv).astype(np.float32)
  smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
  smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def validate(m) -> None:
  """model.family and its keys: each error names the key, the value and what is valid. (Which
  keys a family reads at all is pwtrain/conditions.py's.)"""
  if m.family not in FAMILIES:
    raise ConfigError(f"model.family={m.family!r} is not a family; valid: {', '.join(FAMILIES)}")
  if m.get("activation", "") not in ("", *ACTIVATIONS):
    raise ConfigError(
      f"model.activation={m.activation!r} is not supported; valid: '' (the family's), "
      f"{', '.join(ACTIVATIONS)}"
    )
  if not m.norm_eps > 0:
    raise ConfigError(f"model.norm_eps={m.norm_eps!r} must be > 0")
  if m.rope_scaling not in ROPE_SCALING:
    raise ConfigError(
      f"model.rope_scaling={m.rope_scaling!r} is not supported; valid: {', '.join(ROPE_SCALING)}"
    )
  if m.rope_scaling == "llama3" and not (
    m.rope_factor > 0 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
  ):
    raise ConfigError(
      f"model.rope_factor={m.rope_factor!r} must be > 0 and model.rope_low_freq_factor="
      f"{m.rope_low_freq_factor!r} < model.rope_high_freq_factor={m.rope_high_freq_factor!r}, "
      "both > 0 (Llama 3.1: 8, 1, 4)"
    )
  for key in ("sliding_window", "sliding_window_pattern", "query_pre_attn_scalar"):
    if not isinstance(m[key], int) or m[key] < 0:
      raise ConfigError(f"model.{key}={m[key]!r} must be an integer >= 0 (0: off)")
  if m.rope_scaling == "llama3" and (
    not isinstance(m.rope_original_max_len, int) or m.rope_original_max_len < 1
  ):
    raise ConfigError(
      f"model.rope_original_max_len={m.rope_original_max_len!r} must be a positive integer"
    )
  for key in ("attn_softcap", "final_softcap"):
    if not m[key] >= 0:
      raise ConfigError(f"model.{key}={m[key]!r} must be >= 0 (0: no soft cap)")
  if m.attn_softcap and m.attention not in WRITTEN_OUT:
    raise ConfigError(
      f"model.attn_softcap={m.attn_softcap} needs model.attention='einsum' or 'invariant' (now "
      f"{m.attention!r}): jax.nn.dot_product_attention has no soft cap"
    )
