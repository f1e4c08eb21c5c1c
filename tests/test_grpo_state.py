"""GRPO's train state: the frozen reference policy (rl.kl_coef > 0) is made at init, stays put
through steps, is checkpointed and restored with the state; `restore.state_from_params` starts a
GRPO run from given params; `Harness.logprobs` reads the policy's and the reference's
log-probs."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, step_through
from test_grpo_layouts import NUM_STEPS, grpo_batches, grpo_config

from pwtrain import restore
from pwtrain.checkpoint import Checkpointer
from pwtrain.harness import Harness

LAYOUT = {"parallel.data": 4, "parallel.tensor": 2}  # one island of 8 devices


def assert_trees_equal(actual, expected):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(actual), jax.device_get(expected))


@pytest.fixture(scope="module")
def run():
  """(config, harness, the init state's whole tree, batches, the whole state after the steps)."""
  config = grpo_config(True, **LAYOUT)
  with Harness.build(config) as harness:
    state = harness.init()
    init = jax.device_get(harness.step_program.to_checkpoint(state))
    batches = grpo_batches(config, NUM_STEPS, harness, state)
    # At init the policy is the reference.
    np.testing.assert_array_equal(
      harness.logprobs(state, batches[0], reference=True), harness.logprobs(state, batches[0])
    )
    yield config, harness, init, batches, step_through(harness, state, batches)


@pytest.mark.slow
def test_the_reference_is_the_initial_params_and_stays_put(run):
  config, harness, init, batches, (metrics, state) = run
  assert_trees_equal(init["reference"], init["params"])
  whole = jax.device_get(harness.step_program.to_checkpoint(state))
  assert_trees_equal(whole["reference"], init["params"])
  assert metrics[-1]["kl"] > 0  # the params moved away from it
  # The reference's log-probs are still the initial policy's; the policy's are not.
  again = harness.step_program.from_checkpoint(
    jax.device_put(init, jax.tree.map(lambda a: a.sharding, harness.step_program.abstract_state))
  )
  moved = harness.step_program.from_checkpoint(
    jax.device_put(whole, jax.tree.map(lambda a: a.sharding, harness.step_program.abstract_state))
  )
  at_init = harness.logprobs(again, batches[0])
  np.testing.assert_array_equal(harness.logprobs(moved, batches[0], reference=True), at_init)
  assert np.abs(harness.logprobs(moved, batches[0]) - at_init).max() > 1e-4


@pytest.mark.slow
def test_a_checkpoint_with_the_reference_restores(run, tmp_path):
  config, harness, init, _, (_, state) = run
  whole = harness.step_program.to_checkpoint(state)
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=1, every=1, async_save=False)
  ckpt.save(NUM_STEPS, whole, {})
  ckpt.wait()
  ckpt.close()
  step, restored = restore.latest(config, str(tmp_path), restore.reading_mesh(config))
  assert step == NUM_STEPS
  assert_trees_equal(restored["reference"], init["params"])
  assert_trees_equal(restored["params"], whole["params"])


@pytest.mark.slow
def test_state_from_params_starts_grpo_from_given_params(run):
  config, harness, init, batches, (ref_metrics, _) = run
  sp = harness.step_program
  # From the initial params: the state init makes, bit for bit, and the same steps.
  same = sp.to_checkpoint(restore.state_from_params(config, sp, init["params"]))
  assert_trees_equal(same, init)
  metrics, _ = step_through(harness, restore.state_from_params(config, sp, init["params"]), batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    assert_trees_close(got, want, "metrics", tol=0)
  # From other params: those are the policy and the reference; the optimizer starts afresh.
  other = jax.tree.map(lambda x: x * 1.5, init["params"])
  started = jax.device_get(sp.to_checkpoint(restore.state_from_params(config, sp, other)))
  assert_trees_equal(started["params"], other)
  assert_trees_equal(started["reference"], other)
  assert_trees_equal(started["opt_state"], init["opt_state"])
