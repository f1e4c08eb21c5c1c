"""The PaLM model: shapes, causality, RoPE, MQA/GQA, shared embedding, no biases, the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_test_config

from pwtrain import step as step_lib
from pwtrain.models import PaLM, arithmetic, lm_loss
from pwtrain.models.layers import causal_attention, rope


@pytest.fixture(scope="module")
def model_and_cfg():
  cfg = tiny_test_config().model
  return PaLM(cfg, rngs=nnx.Rngs(0)), cfg


def test_logits_shape_and_dtype(model_and_cfg):
  model, cfg = model_and_cfg
  logits = model(jnp.ones((3, 10), jnp.int32))
  assert logits.shape == (3, 10, cfg.vocab_size)
  assert logits.dtype == jnp.float32


def test_causal(model_and_cfg):
  model, _ = model_and_cfg
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 2, 200)
  changed = tokens.at[:, 7:].set(5)
  a, b = model(tokens), model(changed)
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-6, atol=1e-6)
  assert not np.allclose(a[:, 7:], b[:, 7:])


def test_no_biases_and_param_count(model_and_cfg):
  model, _ = model_and_cfg
  config = tiny_test_config()
  state = nnx.state(model, nnx.Param)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(state)[0]]
  assert not [p for p in paths if "bias" in p]
  total = sum(x.size for x in jax.tree.leaves(state))
  assert total == arithmetic.param_count(config.model, config.moe)


def test_multi_query_attention_shapes(model_and_cfg):
  model, cfg = model_and_cfg
  attn = model.blocks[0].attn
  assert attn.wq.shape == (cfg.d_model, cfg.num_heads, cfg.head_dim)
  assert attn.wk.shape == (cfg.d_model, 1, cfg.head_dim)
  assert attn.wv.shape == (cfg.d_model, 1, cfg.head_dim)


def test_grouped_query_attention_runs():
  cfg = tiny_test_config(**{"model.num_kv_heads": 2}).model
  model = PaLM(cfg, rngs=nnx.Rngs(0))
  assert model.blocks[0].attn.wk.shape == (cfg.d_model, 2, cfg.head_dim)
  assert model(jnp.ones((1, 5), jnp.int32)).shape == (1, 5, cfg.vocab_size)


def test_output_layer_is_the_shared_embedding_scaled(model_and_cfg):
  model, cfg = model_and_cfg
  x = jax.random.normal(jax.random.key(2), (1, 4, cfg.d_model))
  expected = model.final_norm(x) @ model.embedding[...].T / np.sqrt(cfg.d_model)
  np.testing.assert_allclose(model.head(x), expected, rtol=1e-5, atol=1e-5)


def test_parallel_block_formulation(model_and_cfg):
  model, cfg = model_and_cfg
  block = model.blocks[0]
  x = jax.random.normal(jax.random.key(3), (2, 6, cfg.d_model))
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  h = block.norm(x)
  np.testing.assert_allclose(
    block(x, pos), x + block.attn(h, pos) + block.mlp(h), rtol=1e-5, atol=1e-5
  )


def test_rope_depends_only_on_relative_position():
  q = jax.random.normal(jax.random.key(4), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(5), (1, 1, 1, 16))

  def score(pq, pk):
    return jnp.sum(rope(q, jnp.array([[pq]]), 1e4) * rope(k, jnp.array([[pk]]), 1e4))

  np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-5)
  assert not np.isclose(score(3, 1), score(3, 2))


def test_loss_masks_padding_and_adds_z_loss():
  logits = jax.random.normal(jax.random.key(6), (2, 3, 7))
  targets = jnp.array([[1, 0, -1], [3, -1, -1]])  # id 0 is a real target; -1 is none
  total, stats = lm_loss(logits, targets, z_loss=1e-4)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  ce = log_z - jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], -1)[..., 0]
  mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
  np.testing.assert_allclose(stats["tokens"], 3)
  np.testing.assert_allclose(stats["ce_sum"], np.sum(np.asarray(ce)[mask]), rtol=1e-6)
  np.testing.assert_allclose(stats["z_sum"], 1e-4 * np.sum(np.square(log_z)[mask]), rtol=1e-6)
  np.testing.assert_allclose(total, stats["ce_sum"] + stats["z_sum"], rtol=1e-6)


def test_stage_slices_compose_to_the_whole_model(model_and_cfg):
  model, cfg = model_and_cfg
  tokens = jax.random.randint(jax.random.key(7), (2, 8), 2, 200)
  x = model.embed(tokens)
  x = model.run_blocks(x, 0, 1)
  x = model.run_blocks(x, 1, cfg.num_layers)
  np.testing.assert_allclose(model.head(x), model(tokens), rtol=1e-6, atol=1e-6)


def test_init_follows_palm():
  """Embedding ~ N(0, 1); kernels have variance 1/fan_in."""
  cfg = tiny_test_config(**{"model.d_model": 256, "model.d_ff": 1024}).model
  fns = step_lib.model_fns(cfg)
  params = fns.init(jax.random.key(0))
  assert abs(float(jnp.std(params["embedding"])) - 1.0) < 0.02
  w_up = params["blocks"][0]["mlp"]["w_up"]
  assert abs(float(jnp.std(w_up)) - cfg.d_model**-0.5) < 0.1 * cfg.d_model**-0.5
  wo = params["blocks"][0]["attn"]["wo"]
  fan_in = cfg.num_heads * cfg.head_dim
  assert abs(float(jnp.std(wo)) - fan_in**-0.5) < 0.1 * fan_in**-0.5


@pytest.mark.parametrize("kv_heads, softcap, window", [(1, 0.0, 0), (2, 5.0, 3)])
def test_invariant_attention_computes_the_einsum_s_attention(kv_heads, softcap, window):
  """layers.attend's `invariant` (products summed by reductions, models.md) is the same
  attention as the einsum's, MQA and GQA, with a soft cap and a sliding window: equal to float
  rounding in float32, and in bfloat16 (where it sums in float32) to bfloat16's."""
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 7, 4, 8))
  k, v = (rng.normal(size=(2, 7, kv_heads, 8)) for _ in range(2))
  for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
    args = [jnp.asarray(a, dtype) for a in (q, k, v)]
    outs = [
      causal_attention(*args, name, softcap=softcap, window=window)
      for name in ("einsum", "invariant")
    ]
    assert outs[1].dtype == dtype
    np.testing.assert_allclose(*(np.asarray(o, np.float32) for o in outs), atol=tol, rtol=tol)
