"""Scanned layers (model.scan_layers, models/scan.py): the same parameters and numbers as the
unrolled model in every layout, checkpoints across the two layouts, decoding, the dry run, and
a step program that does not grow with depth.

Parity is at the project's tolerance (helpers.TOL): a scanned model runs the unrolled model's
operations on the same parameters, differing only in how XLA fuses and orders reductions.
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
from pwtrain import dryrun
from pwtrain import step as step_lib
from pwtrain.checkpoint import Checkpointer
from pwtrain.harness import Harness
from pwtrain.models import PaLM, lm_loss
from pwtrain.models.sampling import Sampling, generate
from pwtrain.parallel.stages import make_stages, unstack_state

SCAN = {"model.scan_layers": True}
# 4 layers, 1 and 3 MoE: two periods of (dense, MoE). The dense model is TINY's 2 layers.
MOE = {"model.num_layers": 4, "moe.num_experts": 8, "moe.top_k": 2, "moe.every": 2, "moe.d_ff": 64}
# Router jitter draws each MoE layer's noise in turn: the scan must draw as the unrolled loop.
# (A pipeline stage keys its noise by its input activation's bits, so layouts whose activations
# differ by rounding draw different noise: pipelines are compared without jitter.)
JITTER = {"moe.jitter": 0.1}
NUM_STEPS = 4
# Pods and stages on one-device islands: the same programs, faster to compile (the 8-device
# mesh is the SPMD layouts' test).
ONE_DEVICE_ISLANDS = {"parallel.devices_per_island": 1}


def config(*overrides: dict):
  return tiny_test_config(**{k: v for o in overrides for k, v in o.items()})


def stage_state(config, key, **stage):
  def init(key):
    model = PaLM(config.model, moe=config.moe, rngs=nnx.Rngs(params=key), **stage)
    return nnx.to_pure_dict(nnx.state(model))

  return jax.jit(init)(key)


@pytest.mark.parametrize(
  "overrides,stage",
  [({"model.num_layers": 3}, {}), (MOE, {"num_layers": 2, "layer_offset": 2, "has_embed": False})],
  ids=["dense", "moe_last_stage"],
)
@pytest.mark.slow
def test_scanned_init_is_the_unrolled_init_stacked(overrides, stage):
  """Bitwise the unrolled parameters, stacked by period; logical axes lead with "layers"."""
  key = jax.random.key(3)
  unrolled = stage_state(config(overrides), key, **stage)
  scanned = stage_state(config(overrides, SCAN), key, **stage)
  assert "blocks" not in scanned and "blocks" in unrolled
  jax.tree.map(np.testing.assert_array_equal, unstack_state(scanned), unrolled)
  c = config(overrides, SCAN)
  axes = step_lib.model_fns(c.model, c.moe).logical_axes["layers"]
  leading = {names[0] for names in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))}
  assert leading == {"layers"}


@pytest.fixture(scope="module")
def grad_reference():
  """Unrolled, one device: gradients at init of the dense and the MoE (with jitter) model."""
  batch = random_batches(config(), 1)[0]
  one = jax.devices()[:1]
  return batch, {
    "dense": grads_at_init(config(), batch, one),
    "moe": grads_at_init(config(MOE, JITTER), batch, one),
  }


GRAD_LAYOUTS = {
  "1dev": ("dense", {}, True),
  "1dev_remat_full": ("dense", {"model.remat": "full"}, True),
  "mesh_dp2_fsdp2_tp2": ("dense", {"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2}),
  "moe_dp2_ep4": ("moe", {**MOE, **JITTER, "parallel.data": 2, "parallel.expert": 4}),
}


@pytest.mark.parametrize("layout", sorted(GRAD_LAYOUTS))
@pytest.mark.slow
def test_gradients_match_unrolled_single_device(grad_reference, layout):
  """Loss sums (MoE sums included) and gradients at init, against the unrolled model."""
  batch, references = grad_reference
  model, overrides, *one_device = GRAD_LAYOUTS[layout]
  ref_grads, ref_stats = references[model]
  devices = jax.devices()[:1] if one_device else None
  grads, stats = grads_at_init(config(overrides, SCAN), batch, devices)
  assert set(stats) == set(ref_stats)
  for key in ref_stats:
    assert_close(stats[key], ref_stats[key], key)
  assert_trees_close(unstack_state(grads), ref_grads, "grads")


def test_remat_applies_to_each_scanned_block():
  """What autodiff keeps for the backward (the residuals of jax.vjp, traced only) shrinks with
  the policy, by exactly the unrolled model's bytes: the policy applies to every block."""
  tokens = jnp.zeros((3, 32), jnp.int32)  # batch 3: no parameter has a dim of 3

  def kept(*overrides):
    fns = step_lib.model_fns(config({"model.num_layers": 4}, *overrides).model)
    loss = lambda p: lm_loss(fns.module(p)(tokens), tokens)[0]
    residuals = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], fns.abstract_params)
    # Activations: [batch, ...] or [batch * length, ...] (SwiGLU's rows) unrolled, with a
    # leading [layers] stacked by the scan.
    rows = {(3,), (3 * 32,)}
    acts = [x for x in jax.tree.leaves(residuals) if rows & {x.shape[:1], x.shape[1:2]}]
    return sum(x.size * x.dtype.itemsize for x in acts)

  policies = ("none", "dots", "outputs", "full")
  scanned = [kept({"model.remat": remat}, SCAN) for remat in policies]
  assert scanned == sorted(scanned, reverse=True) and len(set(scanned)) == 4
  for remat, nbytes in zip(policies[1:], scanned[1:], strict=True):
    assert nbytes == kept({"model.remat": remat}), remat


@pytest.fixture(scope="module")
def reference():
  """Unrolled, one device, SGD: NUM_STEPS steps of the dense model, and of the MoE model."""
  batches = random_batches(config(), NUM_STEPS)
  one = jax.devices()[:1]
  return batches, {
    "dense": run_steps(config(SGD), batches, one),
    "moe": run_steps(config(SGD, MOE), batches, one),
  }


STEP_LAYOUTS = {
  "mesh_dp2_fsdp2_tp2": ("dense", {"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2}),
  "2stages_1f1b_m2": (
    "dense",
    {"parallel.islands": 2, "parallel.stages": 2, "train.num_microbatches": 2},
  ),
  # Overlapped is sync's exchange (a subclass) sent chunk by chunk: each pod's model is cut
  # into 2 cells on its island, which slice the stack like stages.
  "2pods_overlapped_2buckets": (
    "dense",
    {
      **ONE_DEVICE_ISLANDS,
      "parallel.islands": 2,
      "parallel.pods": 2,
      "exchange.mode": "overlapped",
      "exchange.buckets": 2,
    },
  ),
  # Stages cut on periods: layers 0-1 and 2-3, one (dense, MoE) period each. Stage 0 keeps its
  # scanned forward's residuals for its backward.
  "moe_2stages_gpipe_m2": (
    "moe",
    {
      **MOE,
      **ONE_DEVICE_ISLANDS,
      "parallel.islands": 2,
      "parallel.stages": 2,
      "parallel.schedule": "gpipe",
      "parallel.stage_remat": "none",
      "train.num_microbatches": 2,
    },
  ),
}


def assert_steps_close(metrics, state, ref_metrics, ref_state):
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("loss", "ce_loss", "z_loss", "grad_norm", "tokens", "lr"):
      assert_close(got[key], want[key], key)
  assert_trees_close(state["params"], ref_state["params"], "params")
  assert_trees_close(state["opt_state"], ref_state["opt_state"], "opt_state")


@pytest.mark.parametrize("layout", sorted(STEP_LAYOUTS))
@pytest.mark.slow
def test_sgd_steps_match_unrolled_single_device(reference, layout):
  batches, references = reference
  model, overrides = STEP_LAYOUTS[layout]
  metrics, state = run_steps(config(SGD, overrides, SCAN), batches)
  assert "blocks" in state["params"]  # the whole-model state is unrolled
  assert_steps_close(metrics, state, *references[model])


@pytest.mark.parametrize(
  "mode", [{"exchange.mode": "stale"}, {"exchange.mode": "diloco", "exchange.inner_steps": 2}]
)
@pytest.mark.slow
def test_pods_whose_states_differ_match_unrolled(reference, mode):
  """stale and diloco pods against the unrolled model in the same layout (every pod's state).

  DiLoCo's outer momentum is a sum of differences of nearly equal parameters (its entries
  ~1e-3 of theirs), so it carries their rounding at ~1e-3 times the scale: it is checked
  through the parameters it moves (compared after each outer step), not on its own scale."""
  batches, _ = reference
  layout = {**SGD, **ONE_DEVICE_ISLANDS, "parallel.islands": 2, "parallel.pods": 2, **mode}
  want_metrics, want = run_steps(config(layout), batches)
  metrics, got = run_steps(config(layout, SCAN), batches)
  for a, b in zip(metrics, want_metrics, strict=True):
    for key in ("loss", "grad_norm", "tokens", "pod0_loss", "pod1_loss"):
      assert_close(a[key], b[key], key)
  for pod_got, pod_want in zip(got.get("pods", [got]), want.get("pods", [want]), strict=True):
    for tree in (pod_got, pod_want):
      tree.get("outer", {}).pop("opt_state", None)
    assert_trees_close(pod_got, pod_want, "pod state")


@pytest.mark.slow
def test_checkpoints_restore_across_layouts(reference, tmp_path):
  """Real Orbax checkpoints: unrolled -> scanned (one island) -> scanned (2 stages) ->
  unrolled, one step between each (and the eval program on each restored state), equals
  NUM_STEPS unrolled steps; checkpoints hold the layers unrolled. pwtrain.sample then decodes
  the last one alike, scanned or unrolled."""
  batches, references = reference
  ref_metrics, ref_state = references["dense"]
  sides = [
    (config(SGD), jax.devices()[:1]),
    (config(SGD, SCAN, STEP_LAYOUTS["mesh_dp2_fsdp2_tp2"][1]), None),
    (config(SGD, SCAN, STEP_LAYOUTS["2stages_1f1b_m2"][1]), None),
    (config(SGD), jax.devices()[:1]),
  ]
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=5, every=1, async_save=False)
  try:
    for step, (side, devices) in enumerate(sides):
      with Harness.build(side, devices) as harness:
        program = harness.step_program
        # A scanned program's restore target (what it reads and writes) is unrolled too.
        assert set(program.abstract_state["params"]) == {"blocks", "embedding", "final_norm"}
        if step == 0:
          state = harness.init()
        else:
          state = program.from_checkpoint(ckpt.restore(step, program.abstract_state)[0])
        # The eval program on the restored state: its loss is the step's (same params, batch).
        sums = harness.evaluate(state, batches[step : step + 1])
        loss = (sums["ce_sum"] + sums["z_sum"]) / sums["tokens"]
        assert_close(loss, ref_metrics[step]["loss"], f"eval loss {step}")
        out = harness.step(state, batches[step], step)
        assert_close(out.metrics.result()["loss"], ref_metrics[step]["loss"], f"loss {step}")
        state = {k: v.result() for k, v in out.state.items()}
        ckpt.save(step + 1, program.to_checkpoint(state), {"step": step + 1})
        ckpt.wait()
    restored, _ = ckpt.restore(NUM_STEPS, program.abstract_state)
  finally:
    ckpt.close()
  restored = jax.device_get(restored)
  assert_trees_close(restored["params"], ref_state["params"], "params")
  assert_trees_close(restored["opt_state"], ref_state["opt_state"], "opt_state")
  from pwtrain import sample

  texts = [
    sample.sample(
      config(SGD, extra),
      str(tmp_path),
      ["def f(x):"],
      sampling=Sampling(temperature=0),
      max_new_tokens=4,
      num_samples=1,
      seed=0,
      devices=jax.devices()[:1],
    )
    for extra in ({}, SCAN)
  ]
  assert texts[0] == texts[1] and texts[1][0].checkpoint_step == NUM_STEPS


@pytest.mark.slow
def test_scanned_decode_equals_unrolled():
  """Greedy decoding with the KV cache: the scanned MoE model (stacked cache per position of
  the period, scanned decode) produces the unrolled model's tokens."""
  prompts = jnp.asarray(np.random.default_rng(0).integers(2, 200, size=(2, 7)), jnp.int32)
  lengths = jnp.asarray([7, 3], jnp.int32)
  greedy = Sampling(temperature=0)
  out = []
  for extra in ({}, SCAN):
    c = config(MOE, {"model.num_layers": 2}, extra)
    fns = step_lib.model_fns(c.model, c.moe)
    params = fns.init(jax.random.key(1))
    run = lambda p, fns=fns: generate(
      fns.module(p), prompts, lengths, jax.random.key(0), max_new_tokens=5, sampling=greedy
    )
    out.append(jax.device_get(jax.jit(run)(params)))
  np.testing.assert_array_equal(out[1].tokens, out[0].tokens)
  np.testing.assert_array_equal(out[1].lengths, out[0].lengths)


def test_the_scanned_step_does_not_grow_with_depth():
  """The lowered gradient program of 16 scanned layers is the size of 2's; unrolled it grows."""

  def size(layers, scan):
    c = config({"model.num_layers": layers, "model.scan_layers": scan})
    fns = step_lib.model_fns(c.model, c.moe)
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    fn = jax.jit(step_lib.loss_and_grads(fns, z_loss=1e-4))
    return len(fn.lower(fns.abstract_params, {"inputs": tokens, "targets": tokens}).as_text())

  assert size(16, True) < 1.05 * size(2, True)
  assert size(16, False) > 4 * size(2, False)


@pytest.mark.parametrize("name", ["palm_tiny_pipeline", "palm_540b"])
def test_the_dry_run_is_the_same_scanned(name):
  """Same plan, bytes and step time under a remat policy: the layout changes no arithmetic.
  At remat "none" a scanned block keeps only its matmul outputs (remat.scanned_policy), less
  than an unrolled one; that figure alone differs."""
  c = load_config(name)
  with c.unlocked():
    if name != "palm_540b":  # it has its own hardware section
      c.hardware = "tpu_v4"
    c.model.scan_layers = False
    c.model.remat = "dots"
  unrolled = dryrun.estimate(c)
  c.model.scan_layers = True
  scanned = dryrun.estimate(c)
  at_none = []
  for e in (unrolled, scanned):
    at_none.append(e["kept_bytes_per_token"].pop("none"))
    for row in e["islands"]:
      row["activation_bytes_by_remat"].pop("none")
  # Adafactor keeps a (1,) placeholder per factored parameter: one per layer unrolled, one per
  # stack scanned (parallel/stages.py shares it). Only that differs, by the same whole float32s
  # (a multiple of 4 x (layers - 1) bytes) in the optimizer's, the state's and the total bytes.
  layers = c.model.num_layers
  for u, s in zip(unrolled["islands"], scanned["islands"], strict=True):
    extra = {k: u.pop(k) - s.pop(k) for k in ("optimizer_bytes", "state_bytes", "bytes")}
    assert len(set(extra.values())) == 1, extra
    assert extra["bytes"] >= 0 and extra["bytes"] % (4 * (layers - 1)) == 0, extra
  assert scanned == unrolled
  assert at_none[1] < at_none[0]


def test_stages_fall_on_periods():
  """Scanned MoE: balanced stages (and exchange chunks) are cut at multiples of moe.every."""
  c = config(MOE, SCAN, {"model.num_layers": 8, "parallel.stages": 2})
  assert [(s.start, s.stop) for s in make_stages(c)] == [(0, 4), (4, 8)]
  assert [(s.start, s.stop) for s in make_stages(c, 4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {**MOE, "model.num_layers": 5},
      "model.scan_layers=True with MoE scans periods of moe.every=2 layers: "
      "model.num_layers=5 must be a multiple of 2",
    ),
    (
      {"backend.mode": "remote", "backend.workers": ("127.0.0.1:1",)},
      "model.scan_layers=True is not supported with backend.mode='remote'",
    ),
    (
      {**MOE, "parallel.stages": 2, "parallel.stage_boundaries": (0, 1, 4)},
      "parallel.stage_boundaries=(0, 1, 4) must fall on period boundaries: "
      "model.scan_layers=True scans periods of moe.every=2 layers, so every boundary must be "
      "a multiple of 2, e.g. (0, 2, 4)",
    ),
    (
      {**MOE, "parallel.stages": 3},
      "parallel.stages=3 exceeds the 2 periods of moe.every=2 layers that "
      "model.scan_layers=True scans (model.num_layers=4)",
    ),
  ],
  ids=["moe_num_layers", "remote", "boundaries", "stages"],
)
def test_errors_name_the_key(overrides, message):
  c = config(SCAN, overrides)
  with pytest.raises(ValueError, match=re.escape(message)):
    config_lib.validate(c)
    make_stages(c)
