"""Scale features of the model: rematerialisation policies, attention implementations, bf16.

Remat: every policy gives the gradients of no remat, and keeps less for the backward, from none
to dots to outputs to full. What autodiff keeps is measured as the bytes of the residuals it
saves (`jax.ad_checkpoint.saved_residuals`). The compiled temporary memory of the XLA CPU backend
does not show the difference for unrolled layers (it reports ~the same temp size for all
policies: its buffer assignment does not follow the forward/backward liveness), so it is not
what this test reads.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  TOL,
  assert_close,
  assert_trees_close,
  grads_at_init,
  random_batches,
  tiny_test_config,
)

from pwtrain import step as step_lib
from pwtrain.models import lm_loss
from pwtrain.models.layers import causal_attention

BF16_TOL = 2e-2  # bf16 keeps 8 bits of mantissa: ~4e-3 per rounding, a few roundings deep


def _loss_and_params(remat: str):
  config = tiny_test_config(**{"model.remat": remat, "model.num_layers": 3})
  fns = step_lib.model_fns(config.model, config.moe)
  params = fns.init(jax.random.key(0))
  batch = {k: jnp.asarray(v) for k, v in random_batches(config, 1)[0].items()}

  def loss(p):
    return lm_loss(fns.module(p)(batch["inputs"]), batch["targets"])[0]

  return loss, params


@pytest.fixture(scope="module")
def remat_runs():
  out = {}
  for remat in ("none", "dots", "outputs", "full"):
    loss, params = _loss_and_params(remat)
    _, backward = jax.vjp(loss, params)  # a pytree of what the backward needs
    kept = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backward))
    out[remat] = (jax.jit(jax.grad(loss))(params), kept)
  return out


@pytest.mark.slow
def test_remat_policies_give_the_same_gradients(remat_runs):
  grads, _ = remat_runs["none"]
  for remat in ("dots", "outputs", "full"):
    assert_trees_close(remat_runs[remat][0], grads, f"remat={remat} grads", TOL)


def test_remat_policies_keep_less_and_less(remat_runs):
  kept = {remat: remat_runs[remat][1] for remat in remat_runs}
  assert kept["none"] > kept["dots"] > kept["outputs"] > kept["full"], kept


def test_a_bad_remat_policy_names_the_key():
  loss, params = _loss_and_params("everything")
  with pytest.raises(ValueError, match="model.remat='everything' is not a remat policy"):
    jax.grad(loss)(params)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_xla_attention_equals_einsum(kv_heads):
  """jax.nn.dot_product_attention (xla) against the written-out attention, MQA and GQA."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 16, 8, 8))
  k = jax.random.normal(keys[1], (2, 16, kv_heads, 8))
  v = jax.random.normal(keys[2], (2, 16, kv_heads, 8))
  want, got = causal_attention(q, k, v, "einsum"), causal_attention(q, k, v, "xla")
  assert_close(got, want, "xla attention", TOL)
  # Causal: a query sees nothing after it (changing the last key/value moves only the last row).
  moved = causal_attention(q, k.at[:, -1].add(1.0), v.at[:, -1].add(1.0), "xla")
  np.testing.assert_array_equal(np.asarray(moved[:, :-1]), np.asarray(got[:, :-1]))
  assert not np.array_equal(np.asarray(moved[:, -1]), np.asarray(got[:, -1]))


def test_model_with_xla_attention_matches_einsum():
  batch = random_batches(tiny_test_config(), 1)[0]
  one = jax.devices()[:1]
  ref_grads, ref_stats = grads_at_init(tiny_test_config(), batch, one)
  grads, stats = grads_at_init(tiny_test_config(**{"model.attention": "xla"}), batch, one)
  assert_close(stats["loss_sum"], ref_stats["loss_sum"], "loss_sum", TOL)
  assert_trees_close(grads, ref_grads, "grads", TOL)


@pytest.mark.slow
def test_bf16_activations_with_float32_params_match_float32():
  """model.dtype=bfloat16: parameters, gradients and loss sums stay float32, and agree with
  the float32 model to bf16 precision, on one device and on a 2 x 2 x 2 mesh."""
  batch = random_batches(tiny_test_config(), 1)[0]
  one = jax.devices()[:1]
  ref_grads, ref_stats = grads_at_init(tiny_test_config(), batch, one)
  bf16 = {"model.dtype": "bfloat16"}
  grads, stats = grads_at_init(tiny_test_config(**bf16), batch, one)
  assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
  assert_close(stats["loss_sum"], ref_stats["loss_sum"], "bf16 loss_sum", BF16_TOL)
  assert_trees_close(grads, ref_grads, "bf16 grads", BF16_TOL)
  mesh = {"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2}
  mesh_grads, mesh_stats = grads_at_init(tiny_test_config(**bf16, **mesh), batch)
  assert_close(mesh_stats["loss_sum"], stats["loss_sum"], "bf16 mesh loss_sum", BF16_TOL)
  assert_trees_close(mesh_grads, grads, "bf16 mesh grads", BF16_TOL)
