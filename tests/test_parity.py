"""Parallel == single device: DP, FSDP, TP, a mixed mesh and microbatch accumulation.

Each layout runs the same model from the same init on the same batches; the loss, the gradients
and, after two optimizer steps, the parameters and optimizer state must match the 1-device run.

Tolerance. Everything is fp32 and the layouts differ only in the order of reductions across
shards, which perturbs each tensor by ~1e-6 of its largest entry; tensors are compared norm-wise,
max|actual - expected| <= TOL * max|expected|, with TOL fixed once for all layouts (helpers.py).

Optimizer. Adafactor (like Adam) divides each gradient entry by its own RMS, so an entry whose
gradient is ~0 gets an O(lr) update whose sign and size follow rounding noise: its updated
parameters cannot match across reduction orders to any tolerance that still tests something.
So parameters and optimizer state are compared after steps of SGD with momentum, whose update is
linear in the gradient, and the default Adafactor run is compared on its loss and gradient norm;
the gradients themselves, which is what a layout computes, are compared directly.
"""

import jax
import pytest
from helpers import (
  SGD,
  assert_close,
  assert_trees_close,
  grads_at_init,
  random_batches,
  run_steps,
  tiny_test_config,
)

NUM_STEPS = 2


LAYOUTS = {
  "dp8": {"parallel.data": 8},
  "fsdp8": {"parallel.data": 1, "parallel.fsdp": 8},
  "tp8": {"parallel.data": 1, "parallel.tensor": 8},
  "mixed222": {"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2},
  "dp4_tp2_micro2": {"parallel.data": 4, "parallel.tensor": 2, "train.num_microbatches": 2},
  "single_micro4": {"parallel.data": 1, "train.num_microbatches": 4},
}


@pytest.fixture(scope="module")
def reference():
  config = tiny_test_config()
  batches = random_batches(config, NUM_STEPS)
  one = jax.devices()[:1]
  return (
    batches,
    grads_at_init(config, batches[0], one),
    run_steps(config, batches, one),
    run_steps(tiny_test_config(**SGD), batches, one),
  )


def devices_for(layout):
  return jax.devices()[:1] if layout.startswith("single") else jax.devices()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_gradients_match_single_device(reference, layout):
  batches, (ref_grads, ref_stats), _, _ = reference
  config = tiny_test_config(**LAYOUTS[layout])
  grads, stats = grads_at_init(config, batches[0], devices_for(layout))
  for key in ("loss_sum", "ce_sum", "z_sum", "tokens"):
    assert_close(stats[key], ref_stats[key], key)
  assert_trees_close(grads, ref_grads, "grads")


def assert_metrics_close(metrics, ref_metrics):
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("loss", "ce_loss", "z_loss", "grad_norm", "tokens", "lr"):
      assert_close(got[key], want[key], key)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_sgd_steps_match_single_device(reference, layout):
  batches, _, _, (ref_metrics, ref_state) = reference
  config = tiny_test_config(**SGD, **LAYOUTS[layout])
  metrics, state = run_steps(config, batches, devices=devices_for(layout))
  assert_metrics_close(metrics, ref_metrics)
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("param_norm", "update_norm"):  # SGD's update is linear in the gradient
      assert_close(got[key], want[key], key)
  assert_trees_close(state["params"], ref_state["params"], "params")
  assert_trees_close(state["opt_state"], ref_state["opt_state"], "opt_state")
  assert int(state["step"]) == NUM_STEPS


@pytest.mark.parametrize("layout", ["mixed222", "dp4_tp2_micro2"])
@pytest.mark.slow
def test_adafactor_steps_match_single_device(reference, layout):
  batches, _, (ref_metrics, _), _ = reference
  config = tiny_test_config(**LAYOUTS[layout])
  metrics, state = run_steps(config, batches, devices=devices_for(layout))
  assert_metrics_close(metrics, ref_metrics)
  assert int(state["step"]) == NUM_STEPS


def test_param_and_update_norms_are_those_of_the_params_before_and_after_a_step(reference):
  """param_norm and update_norm of one island's step, against the params before and after it."""
  import numpy as np

  from pwtrain.harness import Harness

  batches = reference[0]
  with Harness.build(tiny_test_config(), jax.devices()[:1]) as harness:
    program = harness.step_program
    state = harness.init()
    before = jax.device_get(program.to_checkpoint(state)["params"])
    out = harness.step(state, batches[0], 0)
    metrics = jax.device_get(out.metrics.result())
    after = jax.device_get(program.to_checkpoint({k: v.result() for k, v in out.state.items()}))
  norm = lambda tree: np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in tree))
  after = after["params"]
  assert_close(metrics["param_norm"], norm(jax.tree.leaves(after)), "param_norm")
  update = jax.tree.leaves(jax.tree.map(np.subtract, after, before))
  assert_close(metrics["update_norm"], norm(update), "update_norm")
  assert metrics["update_norm"] > 0


def test_parity_check_detects_a_wrong_layout(reference):
  """The comparison is not vacuous: a different batch order gives different parameters."""
  batches, _, _, (_, ref_state) = reference
  _, state = run_steps(tiny_test_config(**SGD), batches[::-1], devices=jax.devices()[:1])
  with pytest.raises(AssertionError):
    assert_trees_close(state["params"], ref_state["params"], "params")
