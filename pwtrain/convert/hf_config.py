"""A Hugging Face `config.json` <-> pwtrain's `model.*` keys.

`model_keys(hf, path)` reads a config.json (either the rope layout transformers 5 writes,
`rope_parameters`, or the older `rope_theta` + `rope_scaling`) into the keys of a pwtrain config,
refusing in one line, naming the file and the key, anything the families cannot run exactly.
`to_hf(model_cfg, source)` writes the config.json of a pwtrain model: the imported one's
(`source`) with pwtrain's keys put back, or, for a model trained from scratch, the architecture
its keys call for (`architecture`).
"""

from pwtrain.errors import ConfigError

# architecture -> (family, what it adds to the family's base).
ARCHITECTURES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "llama",  # + a sliding window on every layer (model.sliding_window)
  "Qwen2ForCausalLM": "llama",  # + q/k/v biases
  "Qwen3ForCausalLM": "llama",  # + per-head q/k norms
  "GemmaForCausalLM": "gemma",
  "Gemma2ForCausalLM": "gemma",  # + soft caps, local/global layers, post-norms
}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")  # Gemma's "gelu" means tanh (transformers)
_MISSING = object()


class _Reader:
  """Keys of one config.json, each error naming the file and the key."""

  def __init__(self, hf: dict, path: str):
    self.hf, self.path = hf, path

  def get(self, key, default=_MISSING):
    if key in self.hf and self.hf[key] is not None:
      return self.hf[key]
    if default is _MISSING:
      raise ConfigError(f"{self.path}: no key {key!r}, which the model needs")
    return default

  def refuse(self, key, value, supported: str):
    raise ConfigError(f"{self.path}: {key}={value!r} is not supported; supported: {supported}")


def architecture_of(hf: dict, path: str) -> str:
  """The checkpoint's architecture (`architectures[0]`); a ConfigError naming the supported."""
  names = hf.get("architectures") or [None]
  if names[0] not in ARCHITECTURES:
    raise ConfigError(
      f"{path}: architectures={hf.get('architectures')!r} is not supported; supported: "
      f"{', '.join(ARCHITECTURES)}"
    )
  return names[0]


def model_keys(hf: dict, path: str) -> dict:
  """{"model.<key>": value} of the config.json `hf` read from `path`."""
  r = _Reader(hf, path)
  arch = architecture_of(hf, path)
  family = ARCHITECTURES[arch]
  d, heads = r.get("hidden_size"), r.get("num_attention_heads")
  keys = {
    "model.family": family,
    "model.vocab_size": r.get("vocab_size"),
    "model.num_layers": r.get("num_hidden_layers"),
    "model.d_model": d,
    "model.num_heads": heads,
    "model.num_kv_heads": r.get("num_key_value_heads", heads),
    "model.head_dim": r.get("head_dim", d // heads),
    "model.d_ff": r.get("intermediate_size"),
    "model.norm_eps": float(r.get("rms_norm_eps")),
    **_rope(r, family),
  }
  dtype = r.get("torch_dtype", r.get("dtype", "float32"))
  if dtype not in DTYPES:
    r.refuse("torch_dtype", dtype, ", ".join(DTYPES))
  keys["model.param_dtype"] = dtype
  act_key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
  act = r.get(act_key, "silu" if family == "llama" else "gelu_pytorch_tanh")
  if (family == "llama" and act != "silu") or (family == "gemma" and act not in _GELU_TANH):
    r.refuse(act_key, act, "silu" if family == "llama" else "gelu_pytorch_tanh")
  for key in ("mlp_bias", "use_bidirectional_attention"):
    if r.get(key, False):
      r.refuse(key, r.get(key), "false")
  if arch != "Qwen2ForCausalLM" and r.get("attention_bias", False):
    r.refuse("attention_bias", True, f"false for {arch} (q/k/v biases: Qwen2ForCausalLM)")
  if family == "llama":
    keys["model.tie_embeddings"] = bool(r.get("tie_word_embeddings", False))
    keys["model.qkv_bias"] = arch == "Qwen2ForCausalLM"
    keys["model.qk_norm"] = arch == "Qwen3ForCausalLM"
    keys.update(_llama_window(r, arch))
  else:
    if not r.get("tie_word_embeddings", True):
      r.refuse("tie_word_embeddings", False, "true (Gemma's output layer is its embedding)")
    if arch == "Gemma2ForCausalLM":
      keys.update(_gemma2(r, keys["model.num_layers"]))
  return keys


def _rope(r: _Reader, family: str) -> dict:
  params = r.get("rope_parameters", {})
  scaling = r.get("rope_scaling", None) or params
  theta = params.get("rope_theta", r.get("rope_theta", 10000.0))
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if params.get("partial_rotary_factor", r.get("partial_rotary_factor", 1.0)) != 1.0:
    r.refuse("partial_rotary_factor", params.get("partial_rotary_factor"), "1.0")
  keys = {"model.rope_base": float(theta)}
  if kind == "default":
    return keys
  if kind != "llama3" or family != "llama":
    r.refuse("rope_scaling.rope_type", kind, "default, and llama3 for the Llama architectures")
  return {
    **keys,
    "model.rope_scaling": "llama3",
    "model.rope_factor": float(scaling["factor"]),
    "model.rope_low_freq_factor": float(scaling["low_freq_factor"]),
    "model.rope_high_freq_factor": float(scaling["high_freq_factor"]),
    "model.rope_original_max_len": int(scaling["original_max_position_embeddings"]),
  }


def _llama_window(r: _Reader, arch: str) -> dict:
  if arch == "MistralForCausalLM":
    return {"model.sliding_window": int(r.get("sliding_window", 0))}
  if r.get("use_sliding_window", False):
    r.refuse("use_sliding_window", True, "false")
  return {}


def _gemma2(r: _Reader, num_layers: int) -> dict:
  pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
  layer_types = r.get("layer_types", pattern)
  if list(layer_types) != pattern:
    r.refuse("layer_types", layer_types, "sliding and full attention alternating from layer 0")
  return {
    "model.query_pre_attn_scalar": int(r.get("query_pre_attn_scalar")),
    "model.sliding_window": int(r.get("sliding_window")),
    "model.sliding_window_pattern": 2,
    "model.attn_softcap": float(r.get("attn_logit_softcapping", 0.0)),
    "model.final_softcap": float(r.get("final_logit_softcapping", 0.0)),
    "model.post_norms": True,
  }


def architecture(m) -> str:
  """The architecture that runs model config `m` exactly (llama or gemma family); a ConfigError
  when none does."""
  if m.family == "gemma":
    gemma2 = m.post_norms or m.attn_softcap or m.final_softcap or m.sliding_window
    if gemma2 and not (m.post_norms and m.sliding_window and m.sliding_window_pattern == 2):
      raise ConfigError(
        "model.family='gemma' exports as Gemma2ForCausalLM only with model.post_norms=True, "
        "model.sliding_window > 0 and model.sliding_window_pattern=2 (Gemma 2's layers), or as "
        "GemmaForCausalLM with none of them and no soft caps"
      )
    if not gemma2 and m.query_pre_attn_scalar not in (0, m.head_dim):
      raise ConfigError(
        f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} needs Gemma 2's layers "
        "(GemmaForCausalLM scales queries by head_dim^-1/2)"
      )
    return "Gemma2ForCausalLM" if gemma2 else "GemmaForCausalLM"
  if sum(map(bool, (m.qkv_bias, m.qk_norm, m.sliding_window))) > 1:
    raise ConfigError(
      "model.qkv_bias (Qwen2), model.qk_norm (Qwen3) and model.sliding_window (Mistral) export "
      "one at a time: no Hugging Face architecture has two of them"
    )
  if m.sliding_window and m.sliding_window_pattern:
    raise ConfigError(
      f"model.sliding_window_pattern={m.sliding_window_pattern} with model.family='llama': "
      "MistralForCausalLM has a window on every layer (pattern 0)"
    )
  if m.qkv_bias:
    return "Qwen2ForCausalLM"
  if m.qk_norm:
    return "Qwen3ForCausalLM"
  return "MistralForCausalLM" if m.sliding_window else "LlamaForCausalLM"


_MODEL_TYPE = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "GemmaForCausalLM": "gemma",
  "Gemma2ForCausalLM": "gemma2",
}


def to_hf(m, source: dict | None = None) -> dict:
  """The config.json of model config `m`: `source` (the imported checkpoint's, when its
  architecture is still the model's) with every key pwtrain sets replaced."""
  arch = architecture(m)
  out = dict(source) if source and architecture_of(source, "config.json") == arch else {}
  out.update(
    architectures=[arch],
    model_type=_MODEL_TYPE[arch],
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    intermediate_size=m.d_ff,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    rms_norm_eps=m.norm_eps,
    tie_word_embeddings=m.family == "gemma" or m.tie_embeddings,
    dtype=m.param_dtype,
  )
  out.pop("torch_dtype", None)
  out.pop("rope_theta", None)
  out.pop("rope_scaling", None)
  rope = {"rope_theta": m.rope_base, "rope_type": "default"}
  if m.rope_scaling == "llama3":
    rope.update(
      rope_type="llama3",
      factor=m.rope_factor,
      low_freq_factor=m.rope_low_freq_factor,
      high_freq_factor=m.rope_high_freq_factor,
      original_max_position_embeddings=m.rope_original_max_len,
    )
  out["rope_parameters"] = rope
  act = "silu" if m.family == "llama" else "gelu_pytorch_tanh"
  out["hidden_activation" if arch == "Gemma2ForCausalLM" else "hidden_act"] = act
  if arch == "MistralForCausalLM":
    out["sliding_window"] = m.sliding_window
  if arch == "Gemma2ForCausalLM":
    out.update(
      query_pre_attn_scalar=m.query_pre_attn_scalar or m.head_dim,
      sliding_window=m.sliding_window,
      layer_types=[
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(m.num_layers)
      ],
      attn_logit_softcapping=m.attn_softcap or None,
      final_logit_softcapping=m.final_softcap or None,
    )
  return out
