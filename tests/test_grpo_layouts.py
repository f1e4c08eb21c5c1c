"""GRPO (train.objective="grpo") in every layout against the single-device GRPO step: the loss,
every GRPO metric (the mismatch max merged by max across microbatches, shards, stages and
pods), the norms and, after two SGD steps, the parameters (and the frozen reference policy);
tolerances as in test_parity (helpers.TOL)."""

import jax
import numpy as np
import pytest
from helpers import (
  SGD,
  assert_close,
  assert_trees_close,
  run_steps,
  step_through,
  tiny_test_config,
)

from pwtrain import config as config_lib
from pwtrain.errors import ConfigError
from pwtrain.harness import Harness

NUM_STEPS = 2
PROMPT = 8  # the first positions of every row are the prompt: no target
GRPO = {
  **SGD,
  "train.objective": "grpo",
  "train.eval_every": 0,
  "rl.temperature": 0.8,
  "rl.clip_low": 0.15,
  "rl.clip_high": 0.25,
}
METRICS = (
  "loss",
  "pg_loss",
  "kl",
  "z_loss",
  "clip_fraction",
  "ratio_mean",
  "logprob_mismatch_mean",
  "logprob_mismatch_max",
  "tokens",
  "grad_norm",
  "param_norm",
  "update_norm",
)


def grpo_config(kl: bool, **overrides):
  return tiny_test_config(**{**GRPO, "rl.kl_coef": 0.1 if kl else 0.0, **overrides})


def grpo_batches(config, num, harness, state, seed=0):
  """GRPO batches: random sequences whose first PROMPT positions (and some rows' last ones:
  padding) have no target, one advantage per row (one row's 0, a zero-variance group), and
  behaviour log-probs the trainer's at `state` (harness.logprobs) ± 0.4: ratios on both sides of
  the clip."""
  rng = np.random.default_rng(seed)
  b, seq, vocab = config.train.global_batch, config.data.seq_len, config.model.vocab_size
  out = []
  for _ in range(num):
    tokens = rng.integers(1, vocab, (b, seq + 1)).astype(np.int32)
    targets = tokens[:, 1:].copy()
    targets[:, : PROMPT - 1] = -1
    targets[::3, -4:] = -1  # padding after a completion's EOS
    advantages = np.repeat(rng.normal(size=(b, 1)), seq, axis=1).astype(np.float32)
    advantages[1] = 0.0
    batch = {"inputs": tokens[:, :-1], "targets": targets, "advantages": advantages}
    behavior = harness.logprobs(state, batch) + rng.uniform(-0.4, 0.4, (b, seq))
    out.append({**batch, "behavior_logprobs": behavior.astype(np.float32)})
  return out


@pytest.fixture(scope="module")
def references():
  """{kl: (batches, (metrics, whole state))} of the single-device GRPO run, with and without
  the KL penalty; the batches' behaviour log-probs are near the initial policy's."""
  out = {}
  for kl in (True, False):
    config = grpo_config(kl)
    with Harness.build(config, jax.devices()[:1]) as harness:
      state = harness.init()
      batches = grpo_batches(config, NUM_STEPS, harness, state)
      metrics, state = step_through(harness, state, batches)
      out[kl] = batches, (metrics, harness.step_program.to_checkpoint(state))
  return out


MESH = {"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2, "train.num_microbatches": 2}
PODS = {"parallel.islands": 2, "parallel.pods": 2}
STAGES = {"parallel.islands": 2, "parallel.stages": 2, "train.num_microbatches": 2}
LAYOUTS = {  # name: (with the KL penalty, overrides)
  "mesh_dp2_fsdp2_tp2_micro2": (True, MESH),
  "pods2": (True, PODS),
  "pipeline_2stages_1f1b": (False, {**STAGES, "parallel.schedule": "1f1b"}),
  "pipeline_2stages_x_pods2": (False, {**STAGES, "parallel.islands": 4, "parallel.pods": 2}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_grpo_layout_matches_single_device(references, layout):
  kl, overrides = LAYOUTS[layout]
  batches, (ref_metrics, ref_state) = references[kl]
  config = grpo_config(kl, **overrides)
  config_lib.validate(config)
  metrics, state = run_steps(config, batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in METRICS:
      assert_close(got[key], want[key], key)
  # The batch clips on both sides and the KL is there (or not): the comparison tests something.
  assert all(0 < m["clip_fraction"] < 0.5 for m in ref_metrics)
  assert (ref_metrics[1]["kl"] > 0) == kl and ref_metrics[0]["kl"] == 0
  assert_trees_close(state["params"], ref_state["params"], "params")
  assert ("reference" in state) == kl
  if kl:  # frozen: still the initial params, which the first step's KL (0) was measured to
    assert_trees_close(state["reference"], ref_state["reference"], "reference")


def test_a_cut_model_with_the_kl_penalty_is_refused():
  with pytest.raises(ConfigError, match=r"^rl.kl_coef=0.1 needs the reference"):
    config_lib.validate(grpo_config(True, **STAGES))
  with pytest.raises(ConfigError, match=r"^train.eval_every=100 .* set train.eval_every=0$"):
    config_lib.validate(grpo_config(False, **{"train.eval_every": 100}))
