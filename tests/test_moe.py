"""Mixture of Experts: routing and dispatch against a dense reference, the exact drop order,
config errors, expert-parallel parity with one device, pipelines, and an end-to-end run.

The reference computes every expert on every token and weights each token's top-k experts by
its gates; with enough capacity, dispatch/combine (and dropless) must equal it in value and
gradient. Tolerances are test_parity's (fp32; only reduction order differs).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
  SGD,
  assert_close,
  assert_trees_close,
  grads_at_init,
  load_config,
  random_batches,
  run_steps,
  tiny_test_config,
)

from pwtrain import config as config_lib
from pwtrain import train
from pwtrain.models import arithmetic
from pwtrain.models import moe as moe_lib
from pwtrain.models.layers import ACTIVATIONS
from pwtrain.parallel import plan as plan_lib

E, D, F, G, S = 4, 16, 8, 3, 12  # experts, d_model, expert d_ff, groups (sequences), group size


def layer_config(top_k, **moe):
  c = tiny_test_config(**{"model.d_model": D})
  c.moe.num_experts, c.moe.top_k, c.moe.d_ff = E, top_k, F
  for key, value in moe.items():
    c.moe[key] = value
  return c


def make_layer(config, seed=0, activation="silu"):
  layer = moe_lib.MoE(
    config.model, config.moe, rngs=nnx.Rngs(seed), param_dtype=jnp.float32, activation=activation
  )
  return nnx.split(layer)


def apply_layer(graphdef, params, x, train_=True, rngs=None):
  return nnx.merge(graphdef, params)(x, train=train_, rngs=rngs)


def reference(params, x, top_k, act=jax.nn.silu):
  """Every expert on every token; each token's output is the gate-weighted sum of its top-k."""
  logits = x.astype(jnp.float32) @ params["router"][...]
  probs = jax.nn.softmax(logits, axis=-1)
  experts = jnp.argsort(-probs, axis=-1)[..., :top_k]
  gates = jnp.take_along_axis(probs, experts, axis=-1)
  if top_k > 1:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  out = jnp.zeros_like(x)
  for e in range(E):
    w_gate, w_up, w_down = (params[k][...][e] for k in ("w_gate", "w_up", "w_down"))
    y = (act(x @ w_gate) * (x @ w_up)) @ w_down
    weight = jnp.sum(gates * (experts == e), axis=-1)
    out = out + weight[..., None] * y
  return out


def vjp(fn, params, x, cotangent):
  """(params' gradient, x's gradient) of fn's output against `cotangent`."""
  return jax.grad(lambda p, x: jnp.sum(fn(p, x) * cotangent), argnums=(0, 1))(params, x)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dropless", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])  # SwiGLU and GeGLU experts
@pytest.mark.slow
def test_dispatch_equals_dense_reference(top_k, dropless, activation):
  # capacity_factor = E / top_k gives every expert S slots: nothing can drop.
  config = layer_config(top_k, capacity_factor=E / top_k, dropless=dropless)
  graphdef, params = make_layer(config, activation=activation)
  act = ACTIVATIONS[activation]
  x = jax.random.normal(jax.random.key(1), (G, S, D))
  cotangent = jax.random.normal(jax.random.key(2), (G, S, D))
  y, stats = apply_layer(graphdef, params, x)
  assert float(stats["moe_dropped"]) == 0.0
  assert_close(y, reference(params, x, top_k, act), "output")
  got = vjp(lambda p, x: apply_layer(graphdef, p, x)[0], params, x, cotangent)
  want = vjp(lambda p, x: reference(p, x, top_k, act), params, x, cotangent)
  assert_trees_close(got[0], want[0], "param grads")
  assert_close(got[1], want[1], "input grad")
  # Both experts' routes are used (the test is not vacuous).
  assert np.count_nonzero(np.asarray(stats["moe_load"])) > 1


def test_drop_order_top2():
  """First choices are served in token order before any second choice; full experts drop."""
  experts = jnp.array([[[0, 1], [0, 1], [1, 0], [0, 2]]])  # one group of 4 tokens, E=3
  gates = jnp.array([[[0.6, 0.4], [0.7, 0.3], [0.8, 0.2], [0.9, 0.1]]])
  dispatch, combine, kept = moe_lib.dispatch_plan(experts, gates, 3, 2)
  # First choices: t0->e0 slot 0, t1->e0 slot 1, t2->e1 slot 0, t3->e0 full (dropped).
  # Second choices: t0->e1 slot 1, t1->e1 full, t2->e0 full, t3->e2 slot 0.
  np.testing.assert_array_equal(kept[0], [[1, 1], [1, 0], [1, 0], [0, 1]])
  slots = {(s, e, c) for s, e, c in zip(*np.nonzero(np.asarray(dispatch[0])), strict=True)}
  assert slots == {(0, 0, 0), (1, 0, 1), (2, 1, 0), (0, 1, 1), (3, 2, 0)}
  np.testing.assert_allclose(combine[0, 0, 1, 1], 0.4)
  np.testing.assert_allclose(combine[0, 3, 2, 0], 0.1)
  assert float(jnp.sum(combine)) == pytest.approx(0.6 + 0.7 + 0.8 + 0.4 + 0.1)


@pytest.mark.slow
def test_dropped_tokens_get_zero_output():
  """Top-1, 2 experts, capacity 2: the 3rd+ token of each expert passes through with zeros."""
  config = layer_config(1, num_experts=2, capacity_factor=0.5)  # C = ceil(0.5 * 8 / 2) = 2
  graphdef, params = make_layer(config)
  # Dim 0 of x decides the expert: +1 -> expert 0, -1 -> expert 1 (router column 0 vs 1).
  router = np.zeros((D, 2), np.float32)
  router[0] = [8.0, -8.0]
  params["router"] = nnx.Param(jnp.asarray(router))
  route = np.array([0, 0, 0, 1, 0, 1, 1, 1])
  x = np.array(jax.random.normal(jax.random.key(3), (1, 8, D)))
  x[0, :, 0] = np.where(route == 0, 1.0, -1.0)
  y, stats = apply_layer(graphdef, params, jnp.asarray(x))
  dropped = np.array([0, 0, 1, 0, 1, 0, 1, 1], bool)  # tokens 2, 4 (expert 0); 6, 7 (expert 1)
  np.testing.assert_array_equal(np.asarray(y[0, dropped]), 0.0)
  assert np.all(np.abs(np.asarray(y[0, ~dropped])) > 0)
  # Served tokens get exactly what the reference gives them.
  ref = reference(params, jnp.asarray(x), 1)
  assert_close(y[0, ~dropped], ref[0, ~dropped], "served tokens")
  assert float(stats["moe_dropped"]) == 4.0 and float(stats["moe_assignments"]) == 8.0
  np.testing.assert_array_equal(stats["moe_load"], [4.0, 4.0])
  # Eval capacity (2.0 -> C = 8) serves everything.
  y_eval, eval_stats = apply_layer(graphdef, params, jnp.asarray(x), train_=False)
  assert float(eval_stats["moe_dropped"]) == 0.0
  assert_close(y_eval, ref, "eval output")


def test_aux_loss_and_z_loss_sums():
  config = layer_config(2)
  graphdef, params = make_layer(config)
  x = jax.random.normal(jax.random.key(4), (G, S, D))
  _, stats = apply_layer(graphdef, params, x)
  logits = np.asarray(x @ params["router"][...], np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  first = np.argmax(probs, -1)
  aux = 0.0
  for g in range(G):  # Switch/GShard: E * sum_e f_e * P_e per group, times its S tokens
    f = np.bincount(first[g], minlength=E) / S
    aux += S * E * np.sum(f * probs[g].mean(0))
  log_z = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(stats["moe_aux_sum"], aux, rtol=1e-5)
  np.testing.assert_allclose(stats["moe_z_sum"], np.sum(log_z**2), rtol=1e-5)
  assert float(stats["moe_assignments"]) == G * S * 2
  assert float(jnp.sum(stats["moe_load"])) == G * S * 2


def test_jitter_only_with_rngs_and_train():
  config = layer_config(2, jitter=0.5)
  graphdef, params = make_layer(config)
  x = jax.random.normal(jax.random.key(5), (G, S, D))
  rngs = moe_lib.jitter_rngs(config.moe, x)
  assert rngs is not None and moe_lib.jitter_rngs(layer_config(2).moe, x) is None
  plain, _ = apply_layer(graphdef, params, x)
  noisy, _ = apply_layer(graphdef, params, x, rngs=rngs)
  again, _ = apply_layer(graphdef, params, x, rngs=moe_lib.jitter_rngs(config.moe, x))
  evaluated, _ = apply_layer(graphdef, params, x, train_=False, rngs=rngs)
  assert not np.allclose(plain, noisy)
  np.testing.assert_array_equal(noisy, again)  # the noise is a function of the input
  np.testing.assert_array_equal(evaluated, apply_layer(graphdef, params, x, train_=False)[0])


def test_moe_schedule_uses_global_layer_index():
  config = tiny_test_config(**{"model.num_layers": 4})
  config.moe.num_experts, config.moe.every = 4, 2
  assert [moe_lib.is_moe_layer(config.moe, i) for i in range(4)] == [False, True, False, True]
  from pwtrain import step as step_lib

  stage = step_lib.model_fns(config.model, config.moe, num_layers=3, layer_offset=1)
  blocks = stage.abstract_params["blocks"]
  assert ["moe" in blocks[k] for k in range(3)] == [True, False, True]
  assert blocks[0]["moe"]["w_up"].shape == (4, 64, 64)  # moe.d_ff=0: model.d_ff // top_k
  axes = stage.logical_axes["blocks"][0]["moe"]
  assert axes["w_gate"] == ("expert", "embed", "mlp") and axes["w_down"] == (
    "expert",
    "mlp",
    "embed",
  )


def moe_config(**overrides):
  """2 layers (layer 1 MoE), 8 experts, top-2, expert d_ff 64 (dense tiny_test d_ff is 128)."""
  c = tiny_test_config()
  c.moe.num_experts, c.moe.top_k, c.moe.every, c.moe.d_ff = 8, 2, 2, 64
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"parallel.expert": 3, "moe.num_experts": 8},
      "parallel.expert=3 does not divide moe.num_experts=8; valid: 1, 2, 4, 8",
    ),
    ({"moe.top_k": 9}, "moe.top_k=9 must be between 1 and moe.num_experts=8"),
    ({"moe.top_k": 0}, "moe.top_k=0 must be between 1 and moe.num_experts=8"),
    ({"moe.every": 0}, "moe.every=0 must be a positive integer"),
    ({"moe.every": 3}, "moe.every=3 exceeds model.num_layers=2"),
    ({"moe.capacity_factor": 0.0}, "moe.capacity_factor=0.0 must be > 0"),
    (
      {"moe.d_ff": 0, "moe.top_k": 3},
      "moe.d_ff=0 means model.d_ff // moe.top_k, but moe.top_k=3 does not divide model.d_ff=128",
    ),
    ({"moe.jitter": 1.0}, "moe.jitter=1.0 must be in [0, 1)"),
    ({"moe.aux_loss_weight": -1.0}, "moe.aux_loss_weight=-1.0 must be >= 0"),
    ({"moe.num_experts": -2}, "moe.num_experts=-2 must be 0 (dense) or a positive integer"),
    ({"moe.num_experts": 0, "parallel.expert": 2}, "parallel.expert=2 needs moe.num_experts > 0"),
  ],
)
def test_bad_moe_values(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    config_lib.validate(moe_config(**overrides))


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"parallel.data": 1, "parallel.expert": 8, "moe.num_experts": 4},
      "parallel.expert=8 does not divide moe.num_experts=4",
    ),
    (
      {"parallel.data": 1, "parallel.tensor": 8, "moe.d_ff": 4},
      "parallel.tensor=8 does not divide the experts' d_ff=4",
    ),
    (
      {"parallel.data": 1, "parallel.expert": 8, "train.global_batch": 4},
      "parallel.data * parallel.fsdp * parallel.expert * train.num_microbatches = 1 * 8 * 1 = 8",
    ),
    ({"parallel.data": 2, "parallel.expert": 2}, "2 * 1 * 2 * 1 = 4 must equal the 8 devices"),
  ],
)
def test_bad_moe_layout(overrides, message):
  config = moe_config(**overrides)
  with pytest.raises(ValueError, match=re.escape(message)):
    plan_lib.build(config, plan_lib.make_cluster(config))


def test_expert_d_ff_zero_keeps_the_dense_active_size():
  """moe.d_ff=0 is model.d_ff // top_k whatever top_k is: a token's experts add up to d_ff."""
  from pwtrain import step as step_lib

  for top_k, f in ((1, 128), (2, 64), (4, 32)):
    config = moe_config(**{"moe.d_ff": 0, "moe.top_k": top_k})
    assert moe_lib.expert_d_ff(config.model, config.moe) == f
    blocks = step_lib.model_fns(config.model, config.moe).abstract_params["blocks"]
    assert blocks[1]["moe"]["w_down"].shape == (8, f, 64)
    dense = tiny_test_config()
    assert (
      arithmetic.param_count(config.model, config.moe, active=True)
      == arithmetic.param_count(dense.model, dense.moe) + 64 * 8
    )


def test_expert_axis_fills_and_splits_the_batch():
  config = moe_config(**{"parallel.data": 2, "parallel.expert": -1})
  plan = plan_lib.build(config, plan_lib.make_cluster(config))
  assert plan.mesh_shape == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
  assert plan.batch_shards == 8


def test_dense_default_is_unchanged():
  """The shipped default is dense: no moe params, no moe stats, FLOPs as before."""
  config = load_config("palm_tiny")
  assert config.moe.num_experts == 0 and config.parallel.expert == 1
  m = config.model
  attn = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
  dense = m.vocab_size * m.d_model + m.num_layers * (attn + 3 * m.d_model * m.d_ff + m.d_model)
  assert arithmetic.param_count(config.model, config.moe) == dense + m.d_model


# Expert-parallel layouts on the 8 simulated devices, each against the same 1-device run. The
# reference drops tokens (capacity factor 1.25 over 8 experts), so the drop decisions are part
# of what must agree.
LAYOUTS = {
  "ep8": {"parallel.data": 1, "parallel.expert": 8},
  "dp2_ep2_tp2": {"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2},
  "fsdp2_ep4_micro2": {
    "parallel.data": 1,
    "parallel.fsdp": 2,
    "parallel.expert": 4,
    "train.num_microbatches": 2,
  },
}
NUM_STEPS = 2
MOE_STATS = ("moe_aux_sum", "moe_z_sum", "moe_dropped", "moe_assignments", "moe_load")
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max")


@pytest.fixture(scope="module")
def reference_run():
  config = moe_config()
  batches = random_batches(config, NUM_STEPS)
  one = jax.devices()[:1]
  return (
    batches,
    grads_at_init(config, batches[0], one),
    run_steps(moe_config(**SGD), batches, one),
  )


@pytest.mark.slow
def test_reference_drops_tokens_and_adds_aux_losses(reference_run):
  _, (_, stats), (metrics, _) = reference_run
  assert 0 < float(stats["moe_dropped"]) < float(stats["moe_assignments"])
  for m in metrics:
    # The logged loss is the whole objective: LM loss + z-loss + weighted MoE losses.
    cfg = moe_config().moe
    total = (
      m["ce_loss"]
      + m["z_loss"]
      + cfg.aux_loss_weight * m["moe_aux_loss"]
      + cfg.router_z_loss_weight * m["moe_z_loss"]
    )
    np.testing.assert_allclose(m["loss"], total, rtol=1e-6)
    assert 0 < m["moe_dropped_fraction"] < 1 and m["moe_load_max"] > 1 > m["moe_load_min"]
    np.testing.assert_allclose(np.mean([m[f"moe_load_e{i}"] for i in range(8)]), 1.0, rtol=1e-6)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_expert_parallel_gradients_match_single_device(reference_run, layout):
  batches, (ref_grads, ref_stats), _ = reference_run
  grads, stats = grads_at_init(moe_config(**LAYOUTS[layout]), batches[0])
  for key in ("loss_sum", "ce_sum", "z_sum", "tokens", *MOE_STATS):
    assert_close(stats[key], ref_stats[key], key)
  assert_trees_close(grads, ref_grads, "grads")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_expert_parallel_sgd_steps_match_single_device(reference_run, layout):
  batches, _, (ref_metrics, ref_state) = reference_run
  metrics, state = run_steps(moe_config(**SGD, **LAYOUTS[layout]), batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("loss", "ce_loss", "z_loss", "grad_norm", "tokens", *MOE_METRICS):
      assert_close(got[key], want[key], key)
  assert_trees_close(state["params"], ref_state["params"], "params")
  assert_trees_close(state["opt_state"], ref_state["opt_state"], "opt_state")


def test_expert_parallel_dispatch_is_an_all_to_all():
  """On an expert mesh the dispatched tokens move between devices all-to-all (not gathered)."""
  from pwtrain import sharding as sharding_lib
  from pwtrain import step as step_lib
  from pwtrain.parallel import spmd

  config = moe_config(**LAYOUTS["ep8"])
  plan = plan_lib.build(config, plan_lib.make_cluster(config))
  mesh = plan.islands[0].mesh(plan.mesh_shape)
  fns = step_lib.model_fns(config.model, config.moe)
  abstract = {"params": fns.abstract_params}
  shardings = spmd.state_shardings(fns, mesh, abstract)["params"]
  params = spmd.with_shardings(fns.abstract_params, shardings)
  assert shardings["blocks"][1]["moe"]["w_up"].spec[0] == "expert"
  tokens = jax.ShapeDtypeStruct(
    (16, 32), np.int32, sharding=sharding_lib.named_sharding(mesh, ("batch", "length"))
  )
  grad_fn = step_lib.loss_and_grads(fns, z_loss=1e-4)
  with sharding_lib.activate(mesh):
    hlo = jax.jit(grad_fn).lower(params, {"inputs": tokens, "targets": tokens}).compile()
  assert "all-to-all" in hlo.as_text()


PIPE_SGD = {**SGD, "model.num_layers": 4}
PIPELINES = {
  # Stage 1 holds layers 1-3: its local blocks 0 and 2 are the global MoE layers 1 and 3.
  "2stages_1f1b_m2_ep2": {
    "parallel.islands": 2,
    "parallel.stages": 2,
    "parallel.stage_boundaries": (0, 1, 4),
    "parallel.data": 2,
    "parallel.expert": 2,
    "train.num_microbatches": 2,
  },
  # 2 pods of 2 stages, zero_bubble: the last stage's FB passes the MoE stats on and its W adds
  # the parameters' gradient (aux losses included) later. Every stage keeps its forward's
  # residuals (MoE layer 1's among them) for its B and W instead of recomputing them, and each
  # stage's gradients go to the other pod as its W ends (exchange overlapped).
  "2pods_2stages_zero_bubble_keep_overlapped_ep2": {
    "parallel.islands": 4,
    "parallel.pods": 2,
    "parallel.stages": 2,
    "parallel.data": 1,
    "parallel.expert": 2,
    "parallel.schedule": "zero_bubble",
    "parallel.stage_remat": "none",
    "exchange.mode": "overlapped",
    "train.num_microbatches": 2,
  },
  # 2 pods of 2 stages, interleaved: each island holds two one-layer chunks (MoE layers 1 and 3
  # on island 1), and MoE stats go round the islands twice.
  "2pods_2stages_interleaved_v2": {
    "parallel.islands": 4,
    "parallel.pods": 2,
    "parallel.stages": 2,
    "parallel.virtual_stages": 2,
    "parallel.schedule": "interleaved",
    "train.num_microbatches": 2,
  },
}


@pytest.fixture(scope="module")
def pipeline_reference():
  config = moe_config(**PIPE_SGD)
  batches = random_batches(config, NUM_STEPS)
  return batches, run_steps(config, batches, jax.devices()[:1])


@pytest.mark.parametrize("layout", sorted(PIPELINES))
@pytest.mark.slow
def test_pipeline_with_moe_matches_single_device(pipeline_reference, layout):
  batches, (ref_metrics, ref_state) = pipeline_reference
  metrics, state = run_steps(moe_config(**PIPE_SGD, **PIPELINES[layout]), batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("loss", "ce_loss", "z_loss", "grad_norm", "tokens", *MOE_METRICS):
      assert_close(got[key], want[key], key)
  assert_trees_close(state["params"], ref_state["params"], "params")
  assert_trees_close(state["opt_state"], ref_state["opt_state"], "opt_state")


def test_fast_dry_run_model_fns_match_the_moe_model():
  from pwtrain import dryrun
  from pwtrain import step as step_lib

  config = moe_config(**{"model.num_layers": 5})
  full = step_lib.model_fns(config.model, config.moe)
  fast = dryrun.model_fns(config.model, config.moe)
  assert jax.tree.structure(full.abstract_params) == jax.tree.structure(fast.abstract_params)
  assert jax.tree.leaves(full.abstract_params) == jax.tree.leaves(fast.abstract_params)
  assert full.logical_axes == fast.logical_axes
  e = dryrun.estimate(load_config("palm_tiny_moe"))
  assert e["mesh_shape"] == {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}
  assert e["params"] == arithmetic.param_count(
    load_config("palm_tiny_moe").model, load_config("palm_tiny_moe").moe
  )


@pytest.mark.slow
def test_train_run_logs_moe_metrics_and_resumes(tmp_path):
  """pwtrain.train.run with the shipped MoE config (made smaller): 4 steps, stop, resume."""

  def config(steps):
    c = load_config("palm_tiny_moe")
    c.unlock()
    small = {
      "model.num_layers": 2,
      "model.d_model": 64,
      "model.head_dim": 8,
      "model.d_ff": 128,
      "moe.d_ff": 64,
      "data.seq_len": 32,
      "data.max_files": 40,
      "train.log_every": 2,
      "train.checkpoint_every": 2,
      "train.num_steps": steps,
    }
    for key, value in small.items():
      section, name = key.split(".")
      c[section][name] = value
    return c

  straight = train.run(config(4), str(tmp_path / "straight"), show_progress=False)
  rows = straight.history
  assert len(rows) == 4 and all(np.isfinite(r["loss"]) for r in rows)
  for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_e7"):
    assert key in rows[0]
  train.run(config(2), str(tmp_path / "resumed"), show_progress=False)
  resumed = train.run(config(4), str(tmp_path / "resumed"), show_progress=False)
  assert resumed.start_step == 2
  np.testing.assert_array_equal(  # bitwise on CPU
    [r["loss"] for r in resumed.history], [r["loss"] for r in rows[2:]]
  )
