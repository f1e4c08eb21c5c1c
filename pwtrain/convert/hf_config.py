"""A Hugging Face `config.json` <-> pwtrain's `model.*` keys.

`model_keys(hf, path)` reads a config.json (either the rope layout transformers 5 writes,
`rope_parameters`, or the older `rope_theta` + `rope_scaling`) into the keys of a pwtrain config
as transformers reads it: a key it leaves out is transformers' default for the architecture
(hf_defaults.py), the architecture is `architectures[0]` or else `model_type`'s, an activation
is what transformers' ACT2FN computes for its name. Anything the families cannot run exactly is
refused in one line naming the file and the key. `to_hf(model_cfg, source)` writes the
config.json of a pwtrain model, read alike by transformers 4.x and 5.x: the imported one's
(`source`) with pwtrain's keys put back, or, for a model trained from scratch, the architecture
its keys call for (`architecture`).
"""

import json

from pwtrain.convert import hf_defaults
from pwtrain.errors import ConfigError, DataError
from pwtrain.models import family as family_lib

# architecture -> family: what it adds to the family's base is in model_keys.
ARCHITECTURES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "llama",  # + a sliding window on every layer (model.sliding_window)
  "Qwen2ForCausalLM": "llama",  # + q/k/v biases
  "Qwen3ForCausalLM": "llama",  # + per-head q/k norms
  "GemmaForCausalLM": "gemma",
  "Gemma2ForCausalLM": "gemma",  # + soft caps, local/global layers, post-norms
}
# config.json's model_type -> its architecture (what transformers' AutoModelForCausalLM builds).
MODEL_TYPES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "gemma": "GemmaForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
}
_MODEL_TYPE = {arch: model_type for model_type, arch in MODEL_TYPES.items()}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# config.json's activation (a name of transformers' ACT2FN) -> model.activation: "gelu" is the
# exact GELU (erf), the others the tanh approximation. Gemma's config alone reads "gelu" as the
# tanh approximation (transformers' GemmaConfig renames it, a legacy of the first release).
ACTIVATIONS = {
  "silu": "silu",
  "swish": "silu",
  "gelu": "gelu",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_new": "gelu_tanh",
  "gelu_fast": "gelu_tanh",
}
_LEGACY_GELU = {"GemmaForCausalLM": "gelu_pytorch_tanh"}
# model.activation -> the name the export writes (one both transformers 4.x and 5.x read).
ACTIVATION_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def read_json(path: str):
  """The JSON file at `path`; a DataError naming the file and the parse error (one line)."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise DataError(
      f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    ) from None
  except UnicodeDecodeError as e:
    raise DataError(f"{path} is not valid JSON: not UTF-8 text ({e.reason})") from None


def activation_key(arch: str) -> str:
  """The config.json key of the MLP's activation that transformers reads for `arch`."""
  return "hidden_activation" if arch == "Gemma2ForCausalLM" else "hidden_act"


class _Reader:
  """Keys of one config.json of architecture `arch`: a key it leaves out is transformers' default
  for that architecture (hf_defaults.py); each error names the file and the key."""

  def __init__(self, hf: dict, path: str, arch: str):
    self.hf, self.path, self.defaults = hf, path, hf_defaults.DEFAULTS[arch]

  def get(self, key):
    value = self.hf.get(key)
    if value is not None:
      return value
    default = self.defaults[key]
    if key in self.hf and key in hf_defaults.NULL_IS_OFF:
      return None
    if key in self.hf and key in hf_defaults.NULL_IS_DERIVED:
      default = hf_defaults.NULL_IS_DERIVED[key]
    if isinstance(default, hf_defaults.Derived):
      return hf_defaults.DERIVED[default.name](self.get)
    return default

  def refuse(self, key, value, supported: str):
    raise ConfigError(f"{self.path}: {key}={value!r} is not supported; supported: {supported}")


def architecture_of(hf, path: str) -> str:
  """The checkpoint's architecture: `architectures[0]`, or without it the one its `model_type`
  names (as transformers' AutoModelForCausalLM reads it); a ConfigError naming the supported."""
  if not isinstance(hf, dict):
    raise ConfigError(f"{path} is not a JSON object (a Hugging Face config.json)")
  names, model_type = hf.get("architectures"), hf.get("model_type")
  if not names:
    if model_type not in MODEL_TYPES:
      raise ConfigError(
        f"{path}: no architectures, and model_type={model_type!r} is not supported; supported: "
        f"{', '.join(MODEL_TYPES)}"
      )
    return MODEL_TYPES[model_type]
  if not isinstance(names, list) or names[0] not in ARCHITECTURES:
    raise ConfigError(
      f"{path}: architectures={names!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )
  if model_type is not None and MODEL_TYPES.get(model_type) != names[0]:
    raise ConfigError(
      f"{path}: architectures={names!r} but model_type={model_type!r}, which transformers "
      f"builds as {MODEL_TYPES.get(model_type, 'another architecture')}: make them agree"
    )
  return names[0]


def model_keys(hf: dict, path: str) -> dict:
  """{"model.<key>": value} of the config.json `hf` read from `path`."""
  arch = architecture_of(hf, path)
  r = _Reader(hf, path, arch)
  family = ARCHITECTURES[arch]
  keys = {
    "model.family": family,
    "model.vocab_size": r.get("vocab_size"),
    "model.num_layers": r.get("num_hidden_layers"),
    "model.d_model": r.get("hidden_size"),
    "model.num_heads": r.get("num_attention_heads"),
    "model.num_kv_heads": r.get("num_key_value_heads"),
    "model.head_dim": r.get("head_dim"),
    "model.d_ff": r.get("intermediate_size"),
    "model.norm_eps": float(r.get("rms_norm_eps")),
    "model.activation": _activation(r, arch),
    "model.param_dtype": _dtype(r),
    **_rope(r, family),
  }
  for key in ("mlp_bias", "use_bidirectional_attention"):
    if r.get(key):
      r.refuse(key, r.get(key), "false")
  if arch != "Qwen2ForCausalLM" and r.get("attention_bias"):
    r.refuse("attention_bias", True, f"false for {arch} (q/k/v biases: Qwen2ForCausalLM)")
  if family == "llama":
    keys["model.tie_embeddings"] = bool(r.get("tie_word_embeddings"))
    keys["model.qkv_bias"] = arch == "Qwen2ForCausalLM"
    keys["model.qk_norm"] = arch == "Qwen3ForCausalLM"
    keys.update(_llama_window(r, arch))
  else:
    if not r.get("tie_word_embeddings"):
      r.refuse("tie_word_embeddings", False, "true (Gemma's output layer is its embedding)")
    if arch == "Gemma2ForCausalLM":
      keys.update(_gemma2(r))
  return keys


def _meaning(name, arch: str) -> str | None:
  """The model.activation that config.json's activation `name` is for `arch` (None: none)."""
  if name == "gelu" and arch in _LEGACY_GELU:
    name = _LEGACY_GELU[arch]
  return ACTIVATIONS.get(name) if isinstance(name, str) else None


def _activation(r: _Reader, arch: str) -> str:
  key = activation_key(arch)
  activation = _meaning(r.get(key), arch)
  if activation is None:
    r.refuse(key, r.get(key), ", ".join(ACTIVATIONS))
  return activation


def _dtype(r: _Reader) -> str:
  """`dtype` (transformers 5) or `torch_dtype` (4.x), which must agree; float32 without either."""
  given = {k: r.hf[k] for k in ("dtype", "torch_dtype") if r.hf.get(k) is not None}
  if len(set(given.values())) > 1:
    raise ConfigError(
      f"{r.path}: dtype={given['dtype']!r} but torch_dtype="
      f"{given['torch_dtype']!r}: make them agree"
    )
  dtype = next(iter(given.values()), "float32")
  if dtype not in DTYPES:
    r.refuse("torch_dtype", dtype, ", ".join(DTYPES))
  return dtype


def _rope_of(scaling: dict, theta) -> dict:
  """One rope's settings, whichever keys (4.x's or 5.x's) gave them."""
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  out = {"rope_type": kind, "rope_theta": float(scaling.get("rope_theta", theta))}
  if kind == "llama3":
    for key in LLAMA3_KEYS:
      out[key] = scaling.get(key)
  return out


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(r: _Reader, family: str) -> dict:
  """Rope as transformers 5 reads it (`rope_scaling` if set, else `rope_parameters`, their
  rope_theta else the top-level one); a config.json whose 4.x keys (`rope_theta`,
  `rope_scaling`) say otherwise than its `rope_parameters` is refused: the versions would differ."""
  top = r.hf.get("rope_theta") or r.defaults["rope_theta"]
  params, scaling = r.hf.get("rope_parameters") or {}, r.hf.get("rope_scaling") or {}
  rope = _rope_of(scaling or params, top)
  if params and ("rope_theta" in r.hf or scaling):
    older = _rope_of(scaling or {"rope_type": "default"}, top)
    if older != _rope_of(params, top):
      raise ConfigError(
        f"{r.path}: rope_parameters={params!r} but rope_scaling={r.hf.get('rope_scaling')!r}, "
        f"rope_theta={r.hf.get('rope_theta')!r}: transformers 4.x and 5.x would read different "
        "ropes; make them agree"
      )
  factor = (scaling or params).get("partial_rotary_factor", r.hf.get("partial_rotary_factor"))
  if factor not in (None, 1.0):
    r.refuse("partial_rotary_factor", factor, "1.0")
  keys = {"model.rope_base": rope["rope_theta"]}
  if rope["rope_type"] == "default":
    return keys
  if rope["rope_type"] != "llama3" or family != "llama":
    r.refuse(
      "rope_scaling.rope_type", rope["rope_type"], "default, and llama3 for the Llama architectures"
    )
  missing = [k for k in LLAMA3_KEYS if rope[k] is None]
  if missing:
    raise ConfigError(f"{r.path}: rope_type='llama3' without {missing[0]!r}, which it needs")
  return {
    **keys,
    "model.rope_scaling": "llama3",
    "model.rope_factor": float(rope["factor"]),
    "model.rope_low_freq_factor": float(rope["low_freq_factor"]),
    "model.rope_high_freq_factor": float(rope["high_freq_factor"]),
    "model.rope_original_max_len": int(rope["original_max_position_embeddings"]),
  }


def _llama_window(r: _Reader, arch: str) -> dict:
  if arch == "MistralForCausalLM":
    return {"model.sliding_window": int(r.get("sliding_window") or 0)}
  if r.get("use_sliding_window"):
    r.refuse("use_sliding_window", True, "false")
  return {}


def _gemma2(r: _Reader) -> dict:
  layer_types = r.get("layer_types")
  pattern = hf_defaults.DERIVED["alternating"](r.get)
  if list(layer_types) != pattern:
    r.refuse("layer_types", layer_types, "sliding and full attention alternating from layer 0")
  if not r.get("sliding_window"):
    r.refuse("sliding_window", r.get("sliding_window"), "a window > 0 (Gemma 2's local layers)")
  return {
    "model.query_pre_attn_scalar": int(r.get("query_pre_attn_scalar")),
    "model.sliding_window": int(r.get("sliding_window")),
    "model.sliding_window_pattern": 2,
    "model.attn_softcap": float(r.get("attn_logit_softcapping") or 0.0),
    "model.final_softcap": float(r.get("final_logit_softcapping") or 0.0),
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


def to_hf(m, source: dict | None = None) -> dict:
  """The config.json of model config `m`: `source` (the imported checkpoint's, when its
  architecture is still the model's) with every key pwtrain sets replaced, written so that
  transformers 4.x and 5.x read it alike: rope as `rope_parameters` (5.x) and as `rope_theta` +
  `rope_scaling` (4.x; null for the default rope), the dtype as `dtype` and `torch_dtype`, the
  activation under the name `source` gave it (when it still names the model's), and no
  `transformers_version` (the source's would be stale)."""
  arch = architecture(m)
  out = dict(source) if source and architecture_of(source, "config.json") == arch else {}
  out.pop("transformers_version", None)
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
    torch_dtype=m.param_dtype,
    rope_theta=m.rope_base,
    rope_scaling=None,
  )
  out["rope_parameters"] = {"rope_theta": m.rope_base, "rope_type": "default"}
  if m.rope_scaling == "llama3":
    out["rope_scaling"] = {
      "rope_type": "llama3",
      "factor": m.rope_factor,
      "low_freq_factor": m.rope_low_freq_factor,
      "high_freq_factor": m.rope_high_freq_factor,
      "original_max_position_embeddings": m.rope_original_max_len,
    }
    out["rope_parameters"].update(out["rope_scaling"])
  out[activation_key(arch)] = _activation_name(m, arch, out.get(activation_key(arch)))
  if arch == "MistralForCausalLM":
    out["sliding_window"] = m.sliding_window
  if arch == "Gemma2ForCausalLM":
    out.update(
      query_pre_attn_scalar=m.query_pre_attn_scalar or m.head_dim,
      sliding_window=m.sliding_window,
      layer_types=hf_defaults.DERIVED["alternating"](lambda key: m.num_layers),
      attn_logit_softcapping=m.attn_softcap or None,
      final_logit_softcapping=m.final_softcap or None,
    )
  return out


def _activation_name(m, arch: str, given) -> str:
  """The name of `m`'s activation in `arch`'s config.json: `given` (the source's) when it names
  it, else ACTIVATION_NAMES'."""
  activation = family_lib.of(m).activation
  if activation == "gelu" and arch in _LEGACY_GELU:
    raise ConfigError(
      f"model.activation='gelu' (exact GELU): transformers reads {arch}'s activation 'gelu' as "
      "the tanh approximation; export it with model.activation='gelu_tanh', or as Gemma 2"
    )
  return given if _meaning(given, arch) == activation else ACTIVATION_NAMES[activation]
