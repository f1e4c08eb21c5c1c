"""What the import reads from a config.json, checked against the installed transformers without
building a model (pwtrain/convert/hf_config.py, hf_defaults.py): an absent key is the default of
the architecture's transformers config class; an activation runs as transformers' ACT2FN runs
it; what it cannot run exactly is refused in one line naming the file and the key; the export's
config.json reads alike under transformers 4.x's keys and 5.x's.
"""

import copy
import inspect
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO
from hf_models import torch, transformers

from pwtrain import defaults
from pwtrain.convert import hf_config, hf_defaults
from pwtrain.errors import UserError
from pwtrain.models.layers import ACTIVATIONS

CLASSES = {arch: f"{t.capitalize()}Config" for t, arch in hf_config.MODEL_TYPES.items()}
# Sizes away from every class's defaults, so that a derived default (num_key_value_heads =
# num_attention_heads, head_dim = hidden_size // num_attention_heads) differs from a constant.
PROBE = dict(hidden_size=96, num_attention_heads=12, num_hidden_layers=3, intermediate_size=40)


@pytest.mark.parametrize("arch", sorted(hf_defaults.DEFAULTS))
def test_an_absent_key_is_read_as_transformers_default(arch):
  """A config.json with only the probe's sizes imports as the config.json transformers' own
  config class writes for it, every default filled in (the table cannot drift from it)."""
  full = getattr(transformers, CLASSES[arch])(**PROBE).to_dict()
  sparse = {"architectures": [arch], "model_type": full["model_type"], **PROBE}
  assert hf_config.model_keys(sparse, "c.json") == hf_config.model_keys(
    {**full, "architectures": [arch]}, "c.json"
  )


@pytest.mark.parametrize("arch", sorted(hf_defaults.DEFAULTS))
def test_every_default_in_the_table_is_the_config_class_default(arch):
  """Each entry of hf_defaults.DEFAULTS, constant or derived, equals what transformers' config
  class sets; a key the class does not have is one transformers never reads, and the table holds
  its "off" value."""
  cls = getattr(transformers, CLASSES[arch])
  plain, probe = cls(), cls(**PROBE)
  for key, want in hf_defaults.DEFAULTS[arch].items():
    if key == "rope_theta":
      assert plain.rope_parameters["rope_theta"] == want
    elif isinstance(want, hf_defaults.Derived):
      ours = hf_defaults.DERIVED[want.name](lambda k, probe=probe: getattr(probe, k))
      if key == "head_dim" and not hasattr(probe, "head_dim"):  # Qwen2: the model computes it
        source = inspect.getsource(transformers.models.qwen2.modeling_qwen2)
        assert "config.hidden_size // config.num_attention_heads" in source
      else:
        assert getattr(probe, key) == ours, key
    elif hasattr(plain, key) and key in hf_defaults._OFF:
      assert not getattr(plain, key) and not want, key  # None or False: off
    elif hasattr(plain, key):
      assert getattr(plain, key) == want, key
    else:
      assert key in hf_defaults._OFF and not want, key


def test_named_defaults_gemma2_soft_caps_and_mistral_window(tmp_path):
  """Gemma 2 without its soft-cap keys has transformers' caps (attention 50, logits 30); Mistral
  without sliding_window has its window of 4096 (each read by transformers from the same file)."""
  for arch, absent, want in (
    ("Gemma2ForCausalLM", ("attn_logit_softcapping", "final_logit_softcapping"), (50.0, 30.0)),
    ("MistralForCausalLM", ("sliding_window",), (4096,)),
  ):
    config = getattr(transformers, CLASSES[arch])(**PROBE).to_dict()
    for key in absent:
      del config[key]
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert tuple(getattr(theirs, k) for k in absent) == want
    keys = hf_config.model_keys(config, "config.json")
    if arch == "MistralForCausalLM":
      assert keys["model.sliding_window"] == 4096
    else:
      assert (keys["model.attn_softcap"], keys["model.final_softcap"]) == (50.0, 30.0)
  # null is a value: no window, no caps (as transformers reads it).
  none = {"architectures": ["Gemma2ForCausalLM"], **PROBE}
  none.update(attn_logit_softcapping=None, final_logit_softcapping=None)
  keys = hf_config.model_keys(none, "c.json")
  assert (keys["model.attn_softcap"], keys["model.final_softcap"]) == (0.0, 0.0)
  mistral = {"architectures": ["MistralForCausalLM"], "sliding_window": None, **PROBE}
  assert hf_config.model_keys(mistral, "c.json")["model.sliding_window"] == 0


def test_activations_run_as_transformers_runs_them():
  """Each activation name the import accepts computes what transformers' ACT2FN computes for
  it ("gelu" exact, not the tanh approximation), and Gemma 1's legacy "gelu" is the tanh
  approximation there as in transformers' GemmaConfig (Gemma 2's is exact)."""
  from transformers.activations import ACT2FN

  x = np.linspace(-6, 6, 2001, dtype=np.float32)
  for name, ours in hf_config.ACTIVATIONS.items():
    theirs = ACT2FN[name](torch.tensor(x)).numpy()
    assert np.max(np.abs(np.asarray(ACTIVATIONS[ours](jnp.asarray(x))) - theirs)) < 1e-6, name
  assert transformers.GemmaConfig(hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
  assert transformers.Gemma2Config(hidden_activation="gelu").hidden_activation == "gelu"
  gemma = {"architectures": ["GemmaForCausalLM"], "hidden_act": "gelu", **PROBE}
  gemma2 = {"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu", **PROBE}
  assert hf_config.model_keys(gemma, "c.json")["model.activation"] == "gelu_tanh"
  assert hf_config.model_keys(gemma2, "c.json")["model.activation"] == "gelu"


def _model_cfg(keys):
  """The model config a run of these imported keys has."""
  config = defaults.get_config()
  for key, value in keys.items():
    config.model[key.removeprefix("model.")] = value
  return config.model


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh"])
def test_the_export_writes_back_the_activation_name_it_imported(name):
  source = {"architectures": ["Gemma2ForCausalLM"], "hidden_activation": name, **PROBE}
  source.update(head_dim=8, query_pre_attn_scalar=8)
  out = hf_config.to_hf(_model_cfg(hf_config.model_keys(source, "c.json")), source)
  assert out["hidden_activation"] == name


def test_the_export_reads_alike_under_transformers_4_and_5_keys():
  """A Llama 3.1 config's export: `rope_theta` + `rope_scaling` (what 4.x reads) and
  `rope_parameters` (5.x) give the same rope when each set is loaded alone by transformers;
  `torch_dtype` equals `dtype`; the source's `transformers_version` is not kept."""
  rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  rope.update(original_max_position_embeddings=64, rope_theta=500000.0)
  source = transformers.LlamaConfig(**PROBE, rope_parameters=dict(rope)).to_dict()
  source.update(architectures=["LlamaForCausalLM"], transformers_version="4.40.0")
  out = hf_config.to_hf(_model_cfg(hf_config.model_keys(source, "c.json")), source)
  assert "transformers_version" not in out and out["torch_dtype"] == out["dtype"] == "float32"
  new = {k: v for k, v in out.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
  old = {k: v for k, v in out.items() if k not in ("rope_parameters", "dtype")}
  assert out["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
  assert out["rope_theta"] == 500000.0
  for written in (out, new, old):
    loaded = transformers.LlamaConfig.from_dict(copy.deepcopy(written))
    assert loaded.rope_parameters == rope, written
  # and the default rope: rope_scaling null (4.x's "no scaling"), the theta top-level too.
  plain = hf_config.to_hf(
    _model_cfg(
      hf_config.model_keys({**source, "rope_parameters": None, "rope_theta": 1e6}, "c.json")
    )
  )
  assert plain["rope_scaling"] is None and plain["rope_theta"] == 1e6
  assert plain["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **PROBE}
# (a change to LLAMA, the key the one-line refusal must name)
REFUSED = {
  "activation": (dict(hidden_act="relu"), "hidden_act='relu'"),
  "mlp bias": (dict(mlp_bias=True), "mlp_bias=True"),
  "attention bias": (dict(attention_bias=True), "attention_bias=True"),
  "rope type": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
  "partial rope": (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
  "dtype": (dict(dtype="int8"), "torch_dtype='int8'"),
  "dtypes disagree": (dict(dtype="float32", torch_dtype="bfloat16"), "torch_dtype='bfloat16'"),
  "ropes disagree": (dict(rope_parameters={"rope_theta": 1e4}, rope_theta=5e5), "rope_theta"),
  "llama3 incomplete": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq"),
  "model type disagrees": (dict(model_type="mistral"), "model_type='mistral'"),
  "no architecture": (dict(architectures=None, model_type="gpt2"), "model_type='gpt2'"),
  "qwen2 window": (
    dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True),
    "use_sliding_window=True",
  ),
  "gemma2 layers": (
    dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", layer_types=["full_attention"]),
    "layer_types",
  ),
  "gemma untied": (
    dict(architectures=["GemmaForCausalLM"], model_type="gemma", tie_word_embeddings=False),
    "tie_word_embeddings=False",
  ),
  "bidirectional attention": (
    dict(use_bidirectional_attention=True),
    "use_bidirectional_attention=True",
  ),
  "gemma2 window null": (
    dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=None),
    "sliding_window=None",
  ),
  "gemma2 window 0": (
    dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=0),
    "sliding_window=0",
  ),
}


@pytest.mark.parametrize("how", sorted(REFUSED))
def test_an_unsupported_setting_is_refused_in_one_line_naming_the_key(how):
  change, key = REFUSED[how]
  with pytest.raises(UserError) as refused:
    hf_config.model_keys({**LLAMA, **change}, "/ckpt/config.json")
  message = str(refused.value)
  assert "\n" not in message and "/ckpt/config.json" in message and key in message, message


# config.json's bytes that are not a Hugging Face config -> what the one line must say
NOT_A_CONFIG = {
  "a JSON list": (b'[{"architectures": ["LlamaForCausalLM"]}]', "is not a JSON object"),
  "a JSON string": (b'"LlamaForCausalLM"', "is not a JSON object"),
  "not UTF-8": (
    '{"architectures": ["LlamaForCausalLM"], "name": "caf\xe9"}'.encode("latin-1"),
    "UTF-8",
  ),
}


@pytest.mark.parametrize("how", sorted(NOT_A_CONFIG))
def test_a_config_json_that_is_not_a_config_object_is_one_line_naming_the_file(tmp_path, how):
  """Valid JSON that is not an object, and bytes that are not UTF-8, are refused as the import
  reads them (hf_config.read_json, then model_keys): one line naming the file, no traceback."""
  content, says = NOT_A_CONFIG[how]
  path = tmp_path / "config.json"
  path.write_bytes(content)
  with pytest.raises(UserError) as refused:
    hf_config.model_keys(hf_config.read_json(str(path)), str(path))
  message = str(refused.value)
  assert "\n" not in message and message.startswith(f"{path} ") and says in message, message


def test_model_type_names_the_architecture_without_architectures(tmp_path):
  """As transformers' AutoModelForCausalLM reads a config.json (it builds from model_type)."""
  without = {k: v for k, v in LLAMA.items() if k != "architectures"}
  assert hf_config.model_keys(without, "c.json") == hf_config.model_keys(LLAMA, "c.json")
  (tmp_path / "config.json").write_text(json.dumps(without))
  assert type(transformers.AutoConfig.from_pretrained(tmp_path)).__name__ == "LlamaConfig"


@pytest.mark.processes
def test_invalid_json_is_one_line_naming_the_file(tmp_path):
  (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],}')
  command = [sys.executable, "-m", "pwtrain.convert", "from_hf", str(tmp_path)]
  proc = subprocess.run(
    [*command, f"--workdir={tmp_path / 'run'}"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {tmp_path / 'config.json'} is not valid JSON: "), last
  assert "line 1 column" in last and not (tmp_path / "run").exists()


def test_model_activation_is_validated_and_replaces_the_family_s():
  from pwtrain import config as config_lib
  from pwtrain.models import family

  config = defaults.get_config()
  config.model.family = "gemma"
  assert family.of(config.model).activation == "gelu_tanh"  # "": the family's
  config.model.activation = "gelu"
  assert family.of(config.model).activation == "gelu"
  config.model.activation = "relu"
  with pytest.raises(UserError, match=r"^model.activation='relu' is not supported; valid: ''"):
    config_lib.validate(config)
