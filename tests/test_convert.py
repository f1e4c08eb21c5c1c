"""Hugging Face checkpoints in and out (pwtrain/convert/), against transformers on a CPU torch
(the models: tests/hf_models.py).

Each architecture is a tiny model with random weights (every tensor drawn, norms included, so
Gemma's 1 + w is tested) built by transformers and saved to a temporary directory with a
tokenizer trained here (a byte-level BPE whose post-processor adds a BOS, wrapped as
transformers' fast tokenizer): nothing is downloaded. Checks: pwtrain's logits equal
transformers' (max |d| <= 1e-4 in float32, KL <= 1e-6); greedy generation by `pwtrain.sample`
equals `generate` for 32 tokens; HF -> pwtrain -> HF is bitwise with equal config keys, and
transformers loads the export; every kind of bad input is one line naming the file and the key,
and writes nothing.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import REPO
from hf_models import MODELS, make_hf, make_imported, torch, transformers
from safetensors import safe_open

from pwtrain import restore
from pwtrain import sample as sample_lib
from pwtrain.convert import exporter, importer, safetensors_io
from pwtrain.errors import UserError
from pwtrain.models.sampling import Sampling


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """{architecture: hf_models.Imported (HF dir, its model, the pwtrain run imported from it)}."""
  return {name: make_imported(name, tmp_path_factory.mktemp(name)) for name in MODELS}


def _logits_both(hf_dir, model, run, tokens):
  config = sample_lib.load_config(None, str(run))
  _, fns, params = sample_lib.restore_params(config, str(run), restore.reading_mesh(config))
  ours = jax.jit(lambda p, t: fns.module(p)(t))(params, tokens)
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits
  return np.asarray(ours, np.float64), theirs.double().numpy()


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_equal_transformers(imported, name):
  hf_dir, model, run = imported[name]
  # 40 positions: past the sliding windows (8) of mistral and gemma2.
  tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 40)).astype(np.int32)
  ours, theirs = _logits_both(hf_dir, model, run, tokens)
  assert np.max(np.abs(ours - theirs)) <= 1e-4, np.max(np.abs(ours - theirs))
  p, q = _log_softmax(theirs), _log_softmax(ours)
  kl = np.sum(np.exp(p) * (p - q), axis=-1)
  assert np.max(kl) <= 1e-6, np.max(kl)


PROMPT = "def main(): return"


@pytest.mark.parametrize("name", ["llama", "gemma", "gemma2"])
def test_greedy_generation_equals_transformers_generate(imported, name):
  """`pwtrain.sample` at temperature 0 (its prompt encoded as the HF tokenizer does: BOS, no
  EOS in front) continues the prompt with transformers' greedy tokens, 32 of them."""
  hf_dir, model, run = imported[name]
  config = sample_lib.load_config(None, str(run))
  (ours,) = sample_lib.sample(
    config,
    str(run),
    [PROMPT],
    sampling=Sampling(temperature=0.0),
    max_new_tokens=32,
    num_samples=1,
    seed=0,
  )
  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  encoded = tok(PROMPT, return_tensors="pt")
  assert encoded.input_ids[0, 0] == tok.bos_token_id
  with torch.no_grad():
    out = model.generate(**encoded, max_new_tokens=32, do_sample=False)
  theirs = tuple(out[0, encoded.input_ids.shape[1] :].tolist())
  assert len(theirs) == 32 and ours.ids == theirs, (ours.ids, theirs)


def _tensors(directory):
  out = {}
  for name in os.listdir(directory):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(directory, name), framework="numpy") as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
  return out


CONFIG_KEYS = (
  "architectures",
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "num_key_value_heads",
  "head_dim",
  "rms_norm_eps",
  "rope_parameters",
  "tie_word_embeddings",
  "sliding_window",
  "query_pre_attn_scalar",
  "attn_logit_softcapping",
  "final_logit_softcapping",
  "layer_types",
  "hidden_act",
  "hidden_activation",
  "dtype",
)


@pytest.mark.processes
def test_round_trip_is_bitwise_and_transformers_loads_the_export(imported, tmp_path):
  """HF -> pwtrain -> HF (the command, sharded by --shard_size) for every architecture: every
  tensor bitwise equal, the config keys that matter equal, and from_pretrained loads it."""
  for name, (hf_dir, _, run) in imported.items():
    out = tmp_path / name
    if name == "llama":
      command = [sys.executable, "-m", "pwtrain.convert", "to_hf", f"--workdir={run}", str(out)]
      proc = subprocess.run(
        [*command, "--shard_size=40KB"], cwd=REPO, capture_output=True, text=True, timeout=300
      )
      assert proc.returncode == 0, proc.stderr[-3000:]
      assert os.path.isfile(out / safetensors_io.INDEX)
    else:
      config = sample_lib.load_config(None, str(run))
      exporter.to_hf(config, str(run), str(out), shard_size=10**9)
    before, after = _tensors(hf_dir), _tensors(out)
    assert sorted(before) == sorted(after), name
    for key, value in before.items():
      assert value.dtype == after[key].dtype and value.shape == after[key].shape, key
      assert value.tobytes() == after[key].tobytes(), f"{name}: {key}"
    a, b = (json.loads((d / "config.json").read_text()) for d in (hf_dir, out))
    assert {k: a.get(k) for k in CONFIG_KEYS} == {k: b.get(k) for k in CONFIG_KEYS}, name
    for file in ("tokenizer.json", "generation_config.json"):
      assert (out / file).read_bytes() == (hf_dir / file).read_bytes(), file
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "llama", attn_implementation="eager"
  )
  tokens = torch.tensor([[1, 5, 9, 13]])
  with torch.no_grad():
    assert torch.equal(loaded(tokens).logits, imported["llama"].model(tokens).logits)


def test_bf16_round_trip_is_bitwise(tmp_path):
  make_hf("gemma2", tmp_path / "hf", dtype=torch.bfloat16)
  importer.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
  config = sample_lib.load_config(None, str(tmp_path / "run"))
  assert config.model.param_dtype == "bfloat16"
  exporter.to_hf(config, str(tmp_path / "run"), str(tmp_path / "out"), shard_size=10**9)
  before, after = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
  assert all(after[k].tobytes() == v.tobytes() for k, v in before.items())


def _damage(directory, how):
  """Breaks a saved HF checkpoint one way; returns (the file, the key) the error must name."""
  config_path = directory / "config.json"
  config = json.loads(config_path.read_text())
  if how == "missing config":
    config_path.unlink()
    return "config.json", "missing"
  if how == "architecture":
    config["architectures"] = ["GPT2LMHeadModel"]
    config_path.write_text(json.dumps(config))
    return "config.json", "LlamaForCausalLM"
  if how == "shape":
    config["intermediate_size"] = 100
    config_path.write_text(json.dumps(config))
    return "model.safetensors", "gate_proj.weight"
  if how == "dtype":
    config["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config))
    return "model.safetensors", "torch_dtype='bfloat16'"
  if how == "tokenizer":
    config["vocab_size"] = 64
    config_path.write_text(json.dumps(config))
    return "tokenizer.json", "vocab_size"
  if how == "missing tokenizer":
    (directory / "tokenizer.json").unlink()
    return "tokenizer.json", "missing"
  raise AssertionError(how)


BAD = ("missing config", "architecture", "shape", "dtype", "tokenizer", "missing tokenizer")


@pytest.mark.parametrize("how", BAD)
def test_bad_input_is_one_line_naming_file_and_key_and_writes_nothing(imported, tmp_path, how):
  import shutil

  source = tmp_path / "hf"
  shutil.copytree(imported["llama"].hf, source)
  file, key = _damage(source, how)
  workdir = tmp_path / "run"
  with pytest.raises(UserError) as refused:
    importer.from_hf(str(source), str(workdir))
  message = str(refused.value)
  assert "\n" not in message and file in message and key in message, message
  assert not workdir.exists()


def test_a_palm_run_is_refused_naming_the_families_that_export(tmp_path):
  from helpers import tiny_test_config

  with pytest.raises(UserError) as refused:
    exporter.to_hf(tiny_test_config(), str(tmp_path), str(tmp_path / "out"), shard_size=1)
  assert "model.family='palm'" in str(refused.value) and "'llama' and 'gemma'" in str(refused.value)
  assert not (tmp_path / "out").exists()


def test_documents_and_prompts_are_encoded_as_transformers_encodes_them(imported):
  """An imported model's text: a document is the HF tokenizer's encoding (its BOS first) then
  EOS; a prompt is that encoding alone, with no EOS in front."""
  from pwtrain.data import build_tokenizer

  hf_dir, _, run = imported["llama"]
  config = sample_lib.load_config(None, str(run))
  ours = build_tokenizer(config.data, str(run))
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
  text = "print(os) # hello"
  ids = theirs(text).input_ids
  assert ids[0] == theirs.bos_token_id
  assert ours.prompt(text).tolist() == ids
  assert ours.document(text).tolist() == [*ids, theirs.eos_token_id]


def test_fine_tuning_is_an_ordinary_run_and_exports_what_it_trained(imported, tmp_path):
  """HF dir -> from_hf -> train.run (resumes at step 0: no data read yet) -> to_hf -> HF dir
  whose logits are the fine-tuned parameters'."""
  import shutil

  from pwtrain import config as config_lib
  from pwtrain import train

  run = tmp_path / "run"
  shutil.copytree(imported["llama"].run, run)
  overrides = {
    "train.num_steps": 2,
    "train.eval_every": 0,
    "data.max_files": 10,
    "data.seq_len": 32,
    "train.global_batch": 8,
  }
  config = config_lib.load(str(run / importer.CONFIG_FILE), overrides)
  config.unlock()
  config.data.tokenizer_path = str(run / "tokenizer" / "tokenizer.json")  # the copy's
  result = train.run(config, str(run), show_progress=False)
  assert (result.start_step, result.final_step) == (0, 2)
  exporter.to_hf(config, str(run), str(tmp_path / "out"), shard_size=10**9)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "out", attn_implementation="eager"
  )
  tokens = np.arange(1, 20, dtype=np.int32)[None]
  _, fns, _ = sample_lib.restore_params(config, str(run), restore.reading_mesh(config))
  ours = np.asarray(fns.module(result.state["params"])(tokens))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert np.max(np.abs(ours - theirs)) <= 1e-4
  before = _tensors(imported["llama"].hf)["lm_head.weight"]
  assert not np.array_equal(_tensors(tmp_path / "out")["lm_head.weight"], before)  # it trained


def _edit_json(path, **changes):
  """Sets (or, with None, removes) keys of a JSON file."""
  data = json.loads(path.read_text())
  for key, value in changes.items():
    data.pop(key, None) if value is None else data.__setitem__(key, value)
  path.write_text(json.dumps(data))


def _stop_tokens(model, directory) -> tuple[int, int]:
  """(reached, unreached): a token transformers' greedy continuation of PROMPT reaches at its
  6th step or later, not before it, and not the EOS (2), which an EOS list makes a stop there;
  and an ordinary token it never reaches, which as a stop changes nothing."""
  tok = transformers.AutoTokenizer.from_pretrained(directory)
  with torch.no_grad():
    out = model.generate(**tok(PROMPT, return_tensors="pt"), max_new_tokens=32, do_sample=False)
  new = out[0, -32:].tolist()
  reached = next(t for i, t in enumerate(new) if i >= 5 and t != 2 and t not in new[:i])
  return reached, next(t for t in range(3, len(tok)) if t not in new)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
  """Checkpoints whose config.json says less than transformers writes, or other than the tiny
  models: {name: (HF dir, the model transformers loads from it, the run imported from it)}.

  gemma2: hidden_activation "gelu" (exact GELU) and no soft-cap keys (transformers: 50 and 30).
  llama: head_dim 24 (not d_model / heads = 16), no `architectures` (model_type only), and
  eos_token_id lists that differ: [2, t] in generation_config.json (which transformers' generate
  reads), t a token its greedy continuation reaches, and [2, u] in config.json, u one it never
  reaches (so a run that read config.json's list would not stop at t)."""
  out = {}
  for name, more in (("gemma2", dict(hidden_activation="gelu")), ("llama", dict(head_dim=24))):
    root = tmp_path_factory.mktemp(f"{name}_variant")
    model = make_hf(name, root / "hf", **more)
    if name == "gemma2":
      _edit_json(root / "hf" / "config.json", attn_logit_softcapping=None,
                 final_logit_softcapping=None)  # fmt: skip
    else:
      reached, unreached = _stop_tokens(model, root / "hf")
      _edit_json(root / "hf" / "config.json", architectures=None, eos_token_id=[2, unreached])
      _edit_json(root / "hf" / "generation_config.json", eos_token_id=[2, reached])
    model = transformers.AutoModelForCausalLM.from_pretrained(
      root / "hf", attn_implementation="eager"
    ).eval()
    importer.from_hf(str(root / "hf"), str(root / "run"))
    out[name] = (root / "hf", model, root / "run")
  return out


@pytest.mark.parametrize("name", ["gemma2", "llama"])
def test_what_config_json_leaves_out_runs_as_transformers_runs_it(variants, name):
  """Logits equal transformers' for Gemma 2 with exact GELU and transformers' default soft caps,
  and for a Llama whose head_dim is not d_model / heads, read from model_type alone."""
  hf_dir, model, run = variants[name]
  if name == "gemma2":  # what transformers read for the absent keys
    assert (model.config.attn_logit_softcapping, model.config.final_logit_softcapping) == (50, 30)
  else:
    assert model.config.head_dim == 24 != model.config.hidden_size // 4
  tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 40)).astype(np.int32)
  ours, theirs = _logits_both(hf_dir, model, run, tokens)
  assert np.max(np.abs(ours - theirs)) <= 1e-4, np.max(np.abs(ours - theirs))


def test_generation_stops_at_every_eos_of_the_list(variants):
  """An eos_token_id list (Llama 3's): `pwtrain.sample` stops where transformers' generate stops,
  at generation_config.json's list's second id (config.json's list is another), which the
  import carried as data.stop_tokens."""
  hf_dir, model, run = variants["llama"]
  config = sample_lib.load_config(None, str(run))
  stop = json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"][1]
  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert list(config.data.stop_tokens) == [tok.convert_ids_to_tokens(stop)]
  (ours,) = sample_lib.sample(
    config, str(run), [PROMPT], sampling=Sampling(temperature=0.0), max_new_tokens=32,
    num_samples=1, seed=0,
  )  # fmt: skip
  theirs = _greedy(model, tok)
  assert theirs[-1] == stop and len(theirs) < 32
  assert ours.ids == theirs and ours.stopped_at_eos, (ours.ids, theirs)


def _greedy(model, tok) -> tuple:
  """transformers' greedy continuation of PROMPT (at most 32 tokens, to its generation
  config's EOS)."""
  with torch.no_grad():
    out = model.generate(**tok(PROMPT, return_tensors="pt"), max_new_tokens=32, do_sample=False)
  return tuple(out[0, len(tok(PROMPT).input_ids) :].tolist())


def test_serving_stops_at_every_eos_of_the_list(variants):
  """Served greedily (pwtrain.serve, on loopback), the Llama variant's completion ends where
  transformers' generate ends, at generation_config.json's eos_token_id list's second id (not
  config.json's list's): finish_reason "stop"."""
  import httpx

  from pwtrain import serve

  hf_dir, model, run = variants["llama"]
  config = sample_lib.load_config(None, str(run))
  config.serve.update(port=0, max_len=64, max_batch=1, prefill_chunk=16, reload=False)
  with serve.listening(config) as sock:
    running = serve.standalone(config, str(run), sock).start()
    try:
      body = {"model": "m", "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
      out = httpx.post(f"{running.url}/v1/completions", json=body, timeout=300).json()
    finally:
      running.stop()
  theirs = _greedy(model, transformers.AutoTokenizer.from_pretrained(hf_dir))
  assert len(theirs) < 32, theirs
  assert out["choices"][0]["finish_reason"] == "stop", out
  assert out["usage"]["completion_tokens"] == len(theirs), (out, theirs)


@pytest.mark.parametrize("source", ["generation_config.json", "config.json"])
def test_the_stop_list_is_the_one_transformers_generate_reads(variants, tmp_path, source):
  """The EOS list in one file only: generation_config.json's with config.json's eos_token_id a
  single id, or config.json's with no generation_config.json. data.stop_tokens holds the ids of
  the list transformers' generate reads (the model's generation_config) besides the EOS."""
  import shutil

  from pwtrain.convert import tokenizer_files

  hf_dir = tmp_path / "hf"
  shutil.copytree(variants["llama"][0], hf_dir)
  stop = json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"][1]
  if source == "config.json":
    (hf_dir / "generation_config.json").unlink()
    _edit_json(hf_dir / "config.json", eos_token_id=[2, stop])
  else:
    _edit_json(hf_dir / "config.json", eos_token_id=2)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
  assert model.generation_config.eos_token_id == [2, stop]
  config = json.loads((hf_dir / "config.json").read_text())
  keys = tokenizer_files.check(str(hf_dir), config, config["vocab_size"])
  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert keys["data.eos_token"] == tok.convert_ids_to_tokens(2)
  assert list(keys["data.stop_tokens"]) == [tok.convert_ids_to_tokens(stop)]


def test_an_exact_gelu_export_loads_in_transformers_as_imported(variants, tmp_path):
  """The Gemma 2 variant's export keeps hidden_activation "gelu" and, loaded by transformers,
  computes the imported model's logits."""
  hf_dir, model, run = variants["gemma2"]
  config = sample_lib.load_config(None, str(run))
  exporter.to_hf(config, str(run), str(tmp_path / "out"), shard_size=10**9)
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["hidden_activation"] == "gelu"
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "out", attn_implementation="eager"
  )
  tokens = torch.tensor([[1, 5, 9, 13, 40, 41]])
  with torch.no_grad():
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)
