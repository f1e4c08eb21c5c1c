"""Sampling: the KV-cache decoder against the full forward pass, the sampling rule, and the
`python -m pwtrain.sample` command on a freshly trained workdir."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, load_config, small_config, tiny_test_config

from pwtrain import step as step_lib
from pwtrain import train
from pwtrain.data import ByteTokenizer
from pwtrain.models import decode
from pwtrain.models.sampling import Sampling, generate, next_token

NEW = 6  # tokens generated per prompt


def _model(**overrides):
  config = tiny_test_config(**overrides)
  fns = step_lib.model_fns(config.model, config.moe)
  return config, fns, fns.init(jax.random.key(1))


def _generate(fns, params, prompts, lengths, sampling, key=0, eos_id=None):
  fn = jax.jit(
    lambda params, prompts, lengths, key: generate(
      fns.module(params),
      prompts,
      lengths,
      key,
      max_new_tokens=NEW,
      sampling=sampling,
      eos_id=eos_id,
    )
  )
  return jax.device_get(fn(params, prompts, lengths, jax.random.key(key)))


def _prompts(vocab, lengths, seed=0):
  """Right-padded random prompts, one row per length."""
  rng = np.random.default_rng(seed)
  prompts = np.zeros((len(lengths), max(lengths)), np.int32)
  for row, n in enumerate(lengths):
    prompts[row, :n] = rng.integers(2, vocab, size=n)
  return jnp.asarray(prompts), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize(
  "overrides",
  [
    {"model.num_kv_heads": 1},  # MQA
    {"model.num_kv_heads": 2},  # GQA
    # Layer 1 is MoE. Eval capacity min(S, ceil(2 * 2.0 * S / 4)) = S drops nothing, so routing
    # a decoded token alone (decode.py) agrees with routing it with its sequence.
    {"moe.num_experts": 4},
  ],
  ids=["mqa", "gqa", "moe"],
)
def test_greedy_with_the_cache_is_the_argmax_of_the_full_forward(overrides):
  """Every generated token is the argmax of a non-cached forward pass over the row's sequence
  so far; rows of different prompt lengths decode together."""
  config, fns, params = _model(**overrides)
  prompts, lengths = _prompts(config.model.vocab_size, [5, 9, 1])
  out = _generate(fns, params, prompts, lengths, Sampling(temperature=0))
  assert out.tokens.shape == (3, NEW) and list(out.lengths) == [NEW] * 3
  full = jax.jit(lambda params, tokens: fns.module(params)(tokens))
  for row, n in enumerate(np.asarray(lengths)):
    sequence = np.concatenate([np.asarray(prompts)[row, :n], out.tokens[row]])
    # Right-padded to one length (one compile); causal, so the padding changes nothing before it.
    padded = np.zeros((1, prompts.shape[1] + NEW), np.int32)
    padded[0, : len(sequence)] = sequence
    logits = np.asarray(full(params, padded))[0]
    expected = np.argmax(logits[n - 1 : n - 1 + NEW], axis=-1)
    np.testing.assert_array_equal(out.tokens[row], expected, err_msg=f"row {row}")


def test_cached_logits_equal_the_full_forward():
  """Prefill then single-token steps reproduce the full forward's logits (float rounding)."""
  config, fns, params = _model()
  model = fns.module(params)
  tokens, _ = _prompts(config.model.vocab_size, [12, 12])
  expected = np.asarray(model(tokens))
  forward = jax.jit(lambda params, *args: decode.forward(fns.module(params), *args))
  cache = decode.init_cache(model, 2, 12)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  first, cache = forward(params, cache, tokens[:, :8], positions)
  got = [np.asarray(first)]
  for t in range(8, 12):
    logits, cache = forward(params, cache, tokens[:, t : t + 1], jnp.full((2, 1), t))
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["invariant", "einsum"])
def test_invariant_attention_s_cached_logits_equal_the_full_forward_bitwise(attention):
  """grpo_toy's model at the serving engine's shapes in an RL run (rl/rollouts.py): a prefill
  chunk of max_len = seq_len + 1 tokens of 8 rows into their slots, then one-token decodes of
  every row over the cache's max_len keys, against a forward pass over [8, seq_len]. With
  model.attention="invariant" every decoded position's float32 logits equal the forward's
  bitwise (layers.attend; XLA:CPU's reductions by XLA's emitters, platforms.CPU_NUMERICS_FLAG,
  as in every test); with "einsum" the decode's matrix-vector and the forward's matrix products
  round differently, so the check can fail."""
  config = load_config("grpo_toy", {"model.attention": attention})
  fns = step_lib.model_fns(config.model, config.moe)
  params = fns.init(jax.random.key(3))
  rows, length, prompt = 8, config.data.seq_len, 8
  max_len = length + 1
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (rows, length))
  expected = np.asarray(jax.jit(lambda p, x: fns.module(p)(x))(params, tokens))

  @jax.jit
  def run(params, cache, tokens, positions, **kw):
    return decode.forward(fns.module(params), cache, tokens, positions, **kw)

  cache = decode.init_cache(fns.module(params), rows, max_len)
  chunk = np.zeros((rows, max_len), np.int32)
  chunk[:, :prompt] = tokens[:, :prompt]
  positions = np.broadcast_to(np.arange(max_len, dtype=np.int32), chunk.shape)
  at = np.full(rows, prompt - 1, np.int32)
  first, cache = run(params, cache, chunk, positions, rows=np.arange(rows), logits_at=at)
  got = {prompt - 1: np.asarray(first)}
  for t in range(prompt, length):
    positions = np.full((rows, 1), t, np.int32)
    logits, cache = run(params, cache, tokens[:, t : t + 1], positions, logits_at=at * 0)
    got[t] = np.asarray(logits)
  differ = sum(int(np.sum(z != expected[:, t])) for t, z in got.items())
  if attention == "invariant":
    assert differ == 0
  else:
    assert differ > 0


def test_one_sequence_s_prefill_is_padded_to_rows_whose_logits_equal_the_forward_s():
  """A prefill of one sequence, as the serving engine runs it (rows padded to the smallest of
  serve/pieces.prefill_rows, the padding row at a scratch position of another slot), gives the
  float32 logits of the forward pass bitwise under invariant attention: a one-row program's
  output layer is a matrix-vector product, which rounds otherwise (it differs here)."""
  from pwtrain.serve import pieces

  config = load_config("grpo_toy", {"model.attention": "invariant"})
  fns = step_lib.model_fns(config.model, config.moe)
  params = fns.init(jax.random.key(3))
  slots, length, prompt = 8, config.data.seq_len, 8
  max_len = length + 1
  tokens = np.random.default_rng(1).integers(0, config.model.vocab_size, (1, length))
  expected = np.asarray(jax.jit(lambda p, x: fns.module(p)(x))(params, tokens))[0, prompt - 1]

  @jax.jit
  def prefill(params, chunk, positions, rows, at):
    cache = decode.init_cache(fns.module(params), slots, max_len)
    return decode.forward(fns.module(params), cache, chunk, positions, rows=rows, logits_at=at)[0]

  def first_logits(size):
    chunk = np.zeros((size, max_len), np.int32)
    chunk[0, :prompt] = tokens[0, :prompt]
    positions = np.full(chunk.shape, max_len - 1, np.int32)  # padding rows: the scratch place
    positions[0] = np.arange(max_len)
    rows, at = np.arange(size, dtype=np.int32), np.full(size, prompt - 1, np.int32)
    return np.asarray(prefill(params, chunk, positions, rows, at))[0]

  size = min(pieces.prefill_rows(slots))
  assert size == 2
  np.testing.assert_array_equal(first_logits(size), expected)
  assert (first_logits(1) != expected).any()  # why one row is never a program of its own


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_cache_is_mqa_sized(kv_heads):
  """One [batch, max_len, num_kv_heads, head_dim] K and V per layer: num_kv_heads, not
  num_heads (8 here)."""
  config, fns, params = _model(**{"model.num_kv_heads": kv_heads})
  cache = decode.init_cache(fns.module(params), 3, 20)
  m = config.model
  assert len(cache.k) == len(cache.v) == m.num_layers
  for array in cache.k + cache.v:
    assert array.shape == (3, 20, kv_heads, m.head_dim) and array.dtype == jnp.float32


def test_top_k_1_at_temperature_1_is_greedy():
  config, fns, params = _model()
  prompts, lengths = _prompts(config.model.vocab_size, [4, 7])
  greedy = _generate(fns, params, prompts, lengths, Sampling(temperature=0))
  for seed in (0, 1):
    top1 = _generate(fns, params, prompts, lengths, Sampling(temperature=1, top_k=1), key=seed)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def test_sampling_rule():
  """top_k and top_p keep exactly the ids the rule names; ids >= num_tokens never come out."""
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
  keys = jax.random.key(0)

  def drawn(**kw):
    num_tokens = kw.pop("num_tokens", None)
    return set(np.asarray(next_token(logits, keys, Sampling(**kw), num_tokens)).tolist())

  assert drawn(temperature=1) == {0, 1, 2, 3}
  assert drawn(temperature=1, top_k=2) == {0, 1}
  assert drawn(temperature=1, top_p=0.5) == {0}  # 0.5 reached by the first id
  assert drawn(temperature=1, top_p=0.8) == {0, 1}
  assert drawn(temperature=1, top_p=0.81) == {0, 1, 2}
  assert drawn(temperature=1, top_k=3, top_p=0.9) == {0, 1, 2}
  assert drawn(temperature=1, num_tokens=3) == {0, 1, 2}
  assert drawn(temperature=0) == {0}


def test_generation_stops_at_eos():
  """A row stops at EOS (counted), then holds pad; the others go on."""
  config, fns, params = _model()
  prompts, lengths = _prompts(config.model.vocab_size, [5, 9])
  greedy = _generate(fns, params, prompts, lengths, Sampling(temperature=0))
  eos = int(greedy.tokens[0, 2])  # make row 0's third token the EOS
  out = _generate(fns, params, prompts, lengths, Sampling(temperature=0), eos_id=eos)
  row0 = list(greedy.tokens[0])
  stop = row0.index(eos) + 1
  assert out.lengths[0] == stop
  np.testing.assert_array_equal(out.tokens[0], row0[:stop] + [0] * (NEW - stop))


# -- the command ------------------------------------------------------------------------------

# tiny_test_config's model as command-line overrides of configs/palm_tiny.py.
MODEL_FLAGS = [
  "--config.model.num_layers=2",
  "--config.model.d_model=64",
  "--config.model.head_dim=8",
  "--config.model.d_ff=128",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir with a checkpoint after 4 steps, and the run's final state."""
  workdir = tmp_path_factory.mktemp("trained")
  config = small_config(**{"train.num_steps": 4, "train.checkpoint_every": 4})
  result = train.run(config, str(workdir), show_progress=False)
  return config, workdir, jax.device_get(result.state)


def _sample_command(workdir, *args, env=None):
  command = [sys.executable, "-m", "pwtrain.sample", f"--workdir={workdir}", *args]
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _printed(stdout):
  """{(prompt, sample): (header, text)} from the command's output (a text may span lines)."""
  out, key = {}, None
  for line in stdout.splitlines():
    if line.startswith("--- prompt "):
      prompt, sample = line.split(":")[0].removeprefix("--- prompt ").split(", sample ")
      key = int(prompt), int(sample)
      out[key] = (line, [])
    elif key is not None:
      out[key][1].append(line)
  return {k: (header, "\n".join(lines)) for k, (header, lines) in out.items()}


@pytest.mark.processes
def test_command_greedy_continues_the_prompt_as_the_trained_model_does(trained):
  """`--temperature=0` prints the prompt and the greedy continuation of the trained params
  (computed here without a checkpoint, a KV cache's restore, or the command)."""
  config, workdir, state = trained
  prompt = "def main("
  proc = _sample_command(
    workdir,
    "--config=palm_tiny",
    *MODEL_FLAGS,
    f"--prompt={prompt}",
    "--max_new_tokens=8",
    "--temperature=0",
    env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},  # as a user runs it
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Its one line on stderr names the platform: no libtpu errors, no Orbax notices.
  assert proc.stderr.splitlines() == [
    "platform: cpu, 8 devices (simulated on the CPU: no accelerator was found; JAX_PLATFORMS=gpu "
    "or tpu insists on one)"
  ], proc.stderr
  printed = _printed(proc.stdout)
  assert list(printed) == [(0, 0)], proc.stdout
  header, text = printed[0, 0]
  assert "(checkpoint step 4)" in header

  tokenizer = ByteTokenizer()
  ids = np.concatenate([[tokenizer.eos_id], tokenizer.encode(prompt)]).astype(np.int32)
  fns = step_lib.model_fns(config.model, config.moe)
  out = _generate_n(fns, state["params"], ids, 8, tokenizer)
  new = out.tokens[0, : int(out.lengths[0])]
  assert text == prompt + tokenizer.decode(new), (text, new)
  stopped = new[-1] == tokenizer.eos_id
  assert f": {len(new) - stopped} new tokens" in header


def _generate_n(fns, params, ids, n, tokenizer):
  fn = jax.jit(
    lambda params, prompts, lengths: generate(
      fns.module(params),
      prompts,
      lengths,
      jax.random.key(0),
      max_new_tokens=n,
      sampling=Sampling(temperature=0),
      eos_id=tokenizer.eos_id,
      num_tokens=tokenizer.vocab_size,
    )
  )
  return jax.device_get(fn(params, ids[None], np.asarray([len(ids)], np.int32)))


@pytest.mark.processes
def test_command_reads_config_json_and_a_prompt_file(trained, tmp_path):
  """Without --config the run's <workdir>/config.json is used; every prompt of the file gets
  --num_samples samples."""
  config, workdir, _ = trained
  (workdir / "config.json").write_text(json.dumps(config.to_dict()))
  prompts = ["import os", "", "class A:"]
  (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
  try:
    proc = _sample_command(
      workdir,
      f"--prompt_file={tmp_path / 'prompts.txt'}",
      "--num_samples=2",
      "--max_new_tokens=5",
      "--temperature=0.8",
      "--top_k=20",
      "--top_p=0.9",
      "--seed=3",
    )
  finally:
    os.remove(workdir / "config.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = _printed(proc.stdout)
  assert sorted(printed) == [(p, s) for p in range(2) for s in range(2)], proc.stdout
  for (p, _), (_, text) in printed.items():
    assert text.startswith(["import os", "class A:"][p])


@pytest.mark.processes
def test_command_without_a_config_says_how_to_give_one(tmp_path):
  proc = _sample_command(tmp_path, "--prompt=x")
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert "config.json does not exist" in last and "--config=<file>" in last, proc.stderr
