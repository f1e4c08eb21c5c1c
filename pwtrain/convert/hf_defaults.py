"""transformers' own default of every config.json key the import reads, per architecture.

A config.json may leave a key out (one written by hand, or by an older transformers); transformers
then builds the model with its config class's default for that key (`transformers.Gemma2Config`'s
`final_logit_softcapping=30.0`, `MistralConfig`'s `sliding_window=4096`, ...), and so does the
import: `DEFAULTS[architecture][key]`. transformers is not a dependency of pwtrain, so the
defaults are this table; tests/test_convert_defaults.py checks every entry against the installed
transformers' config classes, so that it cannot drift.

A value is a constant, or `Derived(name)`, computed from the other keys (`DERIVED[name]`), as the
config class's `__post_init__` or the model computes it. A key that the architecture's config
class does not have (transformers never reads it: `mlp_bias` for Mistral) holds the value that
means "off", so that the import refuses it when a config.json sets it.

`null` is a value, not an absent key: for the keys in `NULL_IS_OFF` transformers reads it as
"none" (Mistral's `"sliding_window": null` is no window, Gemma 2's soft caps likewise), for those
in `NULL_IS_DERIVED` as the derived value, and for the others the import reads it as absent.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Derived:
  """A default computed from other keys: DERIVED[name](get), `get` reading any key."""

  name: str


DERIVED = {
  "heads": lambda get: get("num_attention_heads"),  # num_key_value_heads: multi-head
  "quotient": lambda get: get("hidden_size") // get("num_attention_heads"),  # head_dim
  # Gemma 2's layer_types: sliding and full attention alternating from layer 0
  "alternating": lambda get: [
    "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(get("num_hidden_layers"))
  ],
}
NULL_IS_OFF = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
NULL_IS_DERIVED = {"num_key_value_heads": Derived("heads"), "head_dim": Derived("quotient")}

# Keys that mean "off" when an architecture's config class lacks them.
_OFF = dict(
  mlp_bias=False,
  attention_bias=False,
  use_bidirectional_attention=False,
  use_sliding_window=False,
)

_LLAMA = dict(
  vocab_size=32000,
  hidden_size=4096,
  intermediate_size=11008,
  num_hidden_layers=32,
  num_attention_heads=32,
  num_key_value_heads=Derived("heads"),
  head_dim=Derived("quotient"),
  hidden_act="silu",
  rms_norm_eps=1e-6,
  rope_theta=10000.0,
  tie_word_embeddings=False,
)

DEFAULTS = {
  "LlamaForCausalLM": {**_OFF, **_LLAMA},
  "MistralForCausalLM": {
    **_OFF,
    **_LLAMA,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
  },
  "Qwen2ForCausalLM": {
    **_OFF,
    **_LLAMA,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
  },
  "Qwen3ForCausalLM": {
    **_OFF,
    **_LLAMA,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "head_dim": 128,
  },
  "GemmaForCausalLM": {
    **_OFF,
    **_LLAMA,
    "vocab_size": 256000,
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
  },
  "Gemma2ForCausalLM": {
    **_OFF,
    **{k: v for k, v in _LLAMA.items() if k != "hidden_act"},
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "layer_types": Derived("alternating"),
  },
}
