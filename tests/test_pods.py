"""Pods: data-parallel replicas on separate islands exchanging gradients.

sync and overlapped must equal one island with the same global batch (norm-wise, as in
test_parity) and keep the pods bitwise identical; compression is lossy by design and is checked
against its own error bound.
"""

import jax
import numpy as np
import pytest
from helpers import (
  SGD,
  assert_close,
  assert_trees_close,
  metrics_rows,
  random_batches,
  run_program,
  run_steps,
  small_config,
  tiny_test_config,
)

from pwtrain.harness import Harness
from pwtrain.parallel.exchange import compression as codec

NUM_STEPS = 2
PODS = {"model.num_layers": 4, "parallel.islands": 2, "parallel.pods": 2}


@pytest.fixture(scope="module")
def reference():
  config = tiny_test_config(**SGD, **{"model.num_layers": 4})
  batches = random_batches(config, NUM_STEPS)
  return batches, run_steps(config, batches, jax.devices()[:1])


def tree_norm(tree) -> float:
  """The global L2 norm of a tree of host arrays, in float64."""
  return float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(tree))))


def run_pods(config, batches):
  """(program, metrics, every pod's final state), on all 8 devices."""
  return run_program(config, batches)


LAYOUTS = {
  "sync": {},
  "overlapped_4buckets": {"exchange.mode": "overlapped", "exchange.buckets": 4},
  "sync_pods_x_2stages": {"parallel.islands": 4, "parallel.stages": 2, "train.num_microbatches": 2},
  "sync_tp2_inside_pods": {"parallel.data": 2, "parallel.tensor": 2},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_pods_match_one_island(reference, layout):
  batches, (ref_metrics, ref_state) = reference
  config = tiny_test_config(**{**SGD, **PODS, **LAYOUTS[layout]})
  program, metrics, states = run_pods(config, batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("loss", "grad_norm", "param_norm", "update_norm", "tokens"):
      assert_close(got[key], want[key], key)
    # Per-pod losses and gradient norms are logged.
    assert {"pod0_loss", "pod1_loss", "pod0_grad_norm", "pod1_grad_norm"} <= set(got)
  whole = jax.device_get(program.to_checkpoint(states))
  assert_trees_close(whole["params"], ref_state["params"], "params")
  assert_trees_close(whole["opt_state"], ref_state["opt_state"], "opt_state")
  # Pods hold bitwise-identical parameters and optimizer state.
  num_stages = len(program.stages)
  for s in range(num_stages):
    jax.tree.map(np.testing.assert_array_equal, states[f"state/0.{s}"], states[f"state/1.{s}"])


@pytest.mark.slow
def test_overlapped_sends_each_bucket_before_the_backward_ends():
  """Each bucket's gradients leave the pod before the backward of the buckets below it."""
  config = tiny_test_config(**SGD, **PODS, **LAYOUTS["overlapped_4buckets"])
  with Harness.build(config) as harness:
    program = harness.step_program
  names = [n.name for n in program.program.nodes]
  # Bucket 3 (the top layers and head) is sent to pod 1 before pod 0 runs bucket 0's backward.
  assert names.index("0>1:g3") < names.index("0:B0.0")
  assert len(program.stages) == 4


@pytest.mark.parametrize("compression,bound", [("bf16", 2**-8), ("int8", 1 / 127)])
def test_compression_round_trip_error(compression, bound):
  x = {
    "a": jax.random.normal(jax.random.key(0), (16, 64)),
    "b": jax.random.normal(jax.random.key(1), (64,)),
  }
  y = codec.decode(codec.encode(x, compression), compression)
  for k in x:
    scale = np.max(np.abs(np.asarray(x[k])), axis=-1, keepdims=True)
    assert np.all(np.abs(np.asarray(y[k]) - np.asarray(x[k])) <= bound * scale + 1e-7)
  assert codec.encoded_bytes(x, compression) < codec.encoded_bytes(x, "none")


@pytest.mark.parametrize("compression", ["bf16", "int8"])
@pytest.mark.slow
def test_compressed_exchange_keeps_pods_identical(reference, compression):
  batches, (ref_metrics, _) = reference
  config = tiny_test_config(**SGD, **PODS, **{"exchange.compression": compression})
  program, metrics, states = run_pods(config, batches)
  jax.tree.map(np.testing.assert_array_equal, states["state/0.0"], states["state/1.0"])
  # The loss of the first step is computed before any compressed update: exact.
  assert_close(metrics[0]["loss"], ref_metrics[0]["loss"], "loss")
  full = 2 * 1  # bytes: (pods - 1) * payload, fp32 payload below
  del full
  assert program.exchange_bytes < codec.encoded_bytes(
    jax.eval_shape(lambda: program.abstract_state["params"]), "none"
  )


@pytest.mark.slow
def test_two_pods_train_checkpoint_and_resume_like_one_island(tmp_path):

  from pwtrain import train

  pods = {"parallel.islands": 2, "parallel.pods": 2, "train.checkpoint_every": 3}
  one = train.run(
    small_config(**{"train.checkpoint_every": 3}), str(tmp_path / "one"), show_progress=False
  )
  first = train.run(
    small_config(**pods, **{"train.num_steps": 6}), str(tmp_path / "pods"), show_progress=False
  )
  second = train.run(small_config(**pods), str(tmp_path / "pods"), show_progress=False)
  assert second.start_step == 6 and second.final_step == 12
  losses = [r["loss"] for r in first.history + second.history]
  np.testing.assert_allclose(losses, [r["loss"] for r in one.history], rtol=1e-4)
  rows = metrics_rows(tmp_path / "pods")
  assert any(r.get("exchange_bytes_per_step", 0) > 0 for r in rows)
  assert all("pod0_loss" in r for r in rows if "loss" in r)


@pytest.mark.slow
def test_stale_exchange_applies_last_steps_gradients():
  """Documented numerics: step t computes g_t at the current parameters and applies g_{t-1}
  (nothing at step 1). So after 2 steps stale equals sync after 1; after 3 steps, with SGD with
  momentum mu and constant lr, theta_3 = theta_0 - lr * g_1 - lr * (mu * g_1 + g_2), where g_1
  and g_2 are both taken at theta_0 (theta_1 = theta_0)."""
  from helpers import grads_at_init

  config = tiny_test_config(**{**SGD, **PODS})
  batches = random_batches(config, 3)
  _, sync_metrics, sync_states = run_pods(config, batches[:1])
  stale_cfg = tiny_test_config(**{**SGD, **PODS, "exchange.mode": "stale"})
  _, _, after2 = run_pods(stale_cfg, batches[:2])
  for key in ("params", "opt_state"):
    assert_trees_close(after2["state/0.0"][key], sync_states["state/0.0"][key], key)

  _, stale_metrics, after3 = run_pods(stale_cfg, batches)
  one = tiny_test_config(**SGD, **{"model.num_layers": 4})
  lr, mu = one.optim.lr, one.optim.b1
  g = []
  for batch in batches[:2]:
    grads, stats = grads_at_init(one, batch, jax.devices()[:1])
    g.append(jax.tree.map(lambda x, t=stats["tokens"]: x / t, grads))
  _, theta0 = run_pods(config, [])[1:]
  expected = jax.tree.map(
    lambda t0, g1, g2: t0 - lr * g1 - lr * (mu * g1 + g2),
    theta0["state/0.0"]["params"],
    g[0],
    g[1],
  )
  assert_trees_close(after3["state/0.0"]["params"], expected, "params")
  # The logged loss is the current step's: at theta_0 for steps 1 and 2.
  assert_close(stale_metrics[0]["loss"], sync_metrics[0]["loss"], "loss")
  # The logged update is the one applied: none at step 1, g_2's at step 3.
  assert stale_metrics[0]["update_norm"] == 0
  delta = jax.tree.map(np.subtract, after3["state/0.0"]["params"], after2["state/0.0"]["params"])
  assert_close(stale_metrics[2]["update_norm"], tree_norm(delta), "update_norm")
  assert_close(stale_metrics[2]["param_norm"], tree_norm(after3["state/0.0"]["params"]), "norm")
  jax.tree.map(np.testing.assert_array_equal, after3["state/0.0"], after3["state/1.0"])


@pytest.mark.slow
def test_diloco_with_one_inner_step_averages_the_pods_sgd_steps():
  """H=1, outer lr 1, no outer momentum: each step the pods' parameters become the mean of
  their own SGD steps, theta - lr * mean_p(g_p / tokens_p), g_p from pod p's half-batch."""
  from helpers import grads_at_init

  overrides = {
    **SGD, **PODS, "optim.b1": 0.0, "optim.clip_norm": 1e9, "exchange.mode": "diloco",
    "exchange.inner_steps": 1,
    "exchange.outer_lr": 1.0, "exchange.outer_momentum": 0.0,
  }  # fmt: skip
  config = tiny_test_config(**overrides)
  batches = random_batches(config, 1)
  program, metrics, states = run_pods(config, batches)
  _, _, init_states = run_pods(config, [])
  one = tiny_test_config(**SGD, **{"model.num_layers": 4, "train.global_batch": 8})
  steps = []
  for rows in (slice(0, 8), slice(8, 16)):
    half = {k: v[rows] for k, v in batches[0].items()}
    grads, stats = grads_at_init(one, half, jax.devices()[:1])
    steps.append(jax.tree.map(lambda x, t=stats["tokens"]: config.optim.lr * x / t, grads))
  theta0 = init_states["state/0.0"]["params"]
  expected = jax.tree.map(lambda t, a, b: t - (a + b) / 2, theta0, *steps)
  assert_trees_close(states["state/0.0"]["params"], expected, "params")
  jax.tree.map(
    np.testing.assert_array_equal, states["state/0.0"]["params"], states["state/1.0"]["params"]
  )
  assert program.per_pod_checkpoint
  # The logged update is the step's inner and outer update together: theta_1 - theta_0.
  theta1 = states["state/0.0"]["params"]
  delta = jax.tree.map(np.subtract, theta1, theta0)
  assert_close(metrics[0]["update_norm"], tree_norm(delta), "update_norm")
  assert_close(metrics[0]["param_norm"], tree_norm(theta1), "param_norm")


@pytest.mark.slow
def test_diloco_pods_diverge_between_outer_steps_and_resume_exactly(tmp_path):
  from pwtrain import train

  diloco = {
    "parallel.islands": 2, "parallel.pods": 2, "exchange.mode": "diloco",
    "exchange.inner_steps": 3, "train.checkpoint_every": 4,
  }  # fmt: skip
  straight = train.run(small_config(**diloco), str(tmp_path / "a"), show_progress=False)
  pods = straight.state["pods"]
  # Step 12 ends with an outer step: parameters agree; the inner optimizer states do not.
  jax.tree.map(np.testing.assert_array_equal, pods[0]["params"], pods[1]["params"])
  same = jax.tree.map(np.array_equal, pods[0]["opt_state"], pods[1]["opt_state"])
  assert not all(jax.tree.leaves(same))
  train.run(
    small_config(**diloco, **{"train.num_steps": 4}), str(tmp_path / "b"), show_progress=False
  )
  resumed = train.run(small_config(**diloco), str(tmp_path / "b"), show_progress=False)
  assert resumed.start_step == 4  # mid-way between outer steps: pods differed when saved
  np.testing.assert_array_equal(
    [r["loss"] for r in resumed.history], [r["loss"] for r in straight.history[4:]]
  )


def test_error_feedback_loses_nothing_over_steps():
  """decode(sent_t) + residual_t == g_t + residual_{t-1}: summed over steps, what was sent
  plus the last residual equals the sum of the gradients."""
  keys = jax.random.split(jax.random.key(3), 4)
  grads = [{"w": jax.random.normal(k, (8, 32))} for k in keys]
  residual = {"w": np.zeros((8, 32), np.float32)}
  sent_total = 0.0
  for g in grads:
    encoded, residual = codec.encode_with_feedback(g, residual, "int8")
    sent_total = sent_total + codec.decode(encoded, "int8")["w"]
  np.testing.assert_allclose(
    sent_total + residual["w"], sum(g["w"] for g in grads), rtol=1e-5, atol=1e-5
  )
  assert np.abs(residual["w"]).max() > 0  # int8 did lose something, and it was kept


@pytest.mark.slow
def test_pods_with_error_feedback_stay_identical_and_resume(tmp_path):
  from pwtrain import train

  ef = {
    "parallel.islands": 2, "parallel.pods": 2, "exchange.compression": "int8",
    "exchange.error_feedback": True, "train.checkpoint_every": 3,
  }  # fmt: skip
  straight = train.run(
    small_config(**ef, **{"train.num_steps": 6}), str(tmp_path / "a"), show_progress=False
  )
  pods = straight.state["pods"]  # residuals differ per pod, so every pod is checkpointed
  jax.tree.map(np.testing.assert_array_equal, pods[0]["params"], pods[1]["params"])
  assert not np.array_equal(
    jax.tree.leaves(pods[0]["residual"])[0], jax.tree.leaves(pods[1]["residual"])[0]
  )
  train.run(small_config(**ef, **{"train.num_steps": 3}), str(tmp_path / "b"), show_progress=False)
  resumed = train.run(
    small_config(**ef, **{"train.num_steps": 6}), str(tmp_path / "b"), show_progress=False
  )
  np.testing.assert_array_equal(
    [r["loss"] for r in resumed.history], [r["loss"] for r in straight.history[3:]]
  )
