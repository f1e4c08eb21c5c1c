"""Evaluation: the forward-only program of every layout sums the same eval losses as one device.

Each layout evaluates the init state, takes one SGD step and evaluates again, and both sums
{"ce_sum", "z_sum", "tokens"} must equal the one-device run's within the parity tolerance (they
differ only in the order of reductions). The state is read, not donated, by the evaluation: the
step after it still runs, and its result is what the second evaluation sees.
"""

import jax
import numpy as np
import pytest
from helpers import SGD, assert_close, random_batches, tiny_test_config

from pwtrain.harness import Harness

MOE = {"moe.num_experts": 4, "moe.every": 1, "moe.top_k": 2}
LAYOUTS = {
  "spmd_dp2_fsdp2_tp2_micro2": {
    "parallel.data": 2,
    "parallel.fsdp": 2,
    "parallel.tensor": 2,
    "train.num_microbatches": 2,
  },
  "pods2_x_stages2": {
    "parallel.islands": 4,
    "parallel.pods": 2,
    "parallel.stages": 2,
    "train.num_microbatches": 2,
  },
  "moe_expert4": {**MOE, "parallel.expert": 4},
  "moe_pipeline_2stages": {**MOE, "parallel.islands": 2, "parallel.stages": 2},
}


def evaluate_around_a_step(config, devices=None):
  """(eval sums at init, eval sums after one step) of `config` on `devices` (default: all)."""
  train_batch = random_batches(config, 1, seed=0)[0]
  eval_batches = random_batches(config, 2, seed=1)
  with Harness.build(config, devices) as harness:
    state = harness.init()
    before = harness.evaluate(state, eval_batches)
    state = harness.step(state, train_batch, 0).state
    after = harness.evaluate(state, eval_batches)
  return before, after


def config_for(layout):
  return tiny_test_config(**SGD, **LAYOUTS[layout])


@pytest.fixture(scope="module")
def one_device():
  """The one-device evaluation of the dense and of the MoE model, computed once."""
  dense = tiny_test_config(**SGD)
  moe = tiny_test_config(**SGD, **MOE)
  return {
    m: evaluate_around_a_step(c, jax.devices()[:1]) for m, c in (("dense", dense), ("moe", moe))
  }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_eval_matches_one_device(one_device, layout):
  config = config_for(layout)
  want = one_device["moe" if config.moe.num_experts else "dense"]
  got = evaluate_around_a_step(config)
  for when, g, w in zip(("init", "after a step"), got, want, strict=True):
    assert g["tokens"] == w["tokens"], when  # every real target counted once
    for key in ("ce_sum", "z_sum"):
      assert_close(g[key], w[key], f"{when}: {key}")


def test_eval_sees_the_step_and_masks_no_targets(one_device):
  (before, after) = one_device["dense"]
  config = tiny_test_config()
  batches = random_batches(config, 2, seed=1)
  real = sum(int(np.sum(b["targets"] >= 0)) for b in batches)
  assert before["tokens"] == after["tokens"] == real < 2 * 16 * 32  # some targets are -1
  # SGD at lr 0.5 on one batch moves the model: a read of a stale or donated state would not.
  assert abs(after["ce_sum"] - before["ce_sum"]) > 1e-3 * before["ce_sum"]
