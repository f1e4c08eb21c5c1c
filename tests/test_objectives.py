"""The GRPO objective (pwtrain/objectives.py) against a NumPy reference: clipping on both sides,
masking, top-k truncation, the k3 KL; and which tokens carry gradient."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, tiny_test_config

from pwtrain import config as config_lib
from pwtrain import objectives
from pwtrain.errors import ConfigError

B, L, V = 4, 6, 11


def rl_config(**kw):
  base = dict(temperature=0.7, top_k=0, top_p=1.0, clip_low=0.2, clip_high=0.3, kl_coef=0.0)
  return types.SimpleNamespace(**{**base, **kw})


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_logprobs(logits, targets, temperature, top_k):
  """log p(target) under softmax(logits / temperature) cut to the top_k largest logits."""
  scaled = logits.astype(np.float64) / temperature
  if top_k:
    kth = -np.sort(-scaled, axis=-1)[..., top_k - 1 : top_k]
    scaled = np.where(scaled < kth, -np.inf, scaled)
  logp = np_log_softmax(scaled)
  safe = np.where(targets >= 0, targets, 0)
  return np.where(targets >= 0, np.take_along_axis(logp, safe[..., None], -1)[..., 0], 0.0)


def np_grpo(logits, batch, rl, z_loss, ref_logits=None):
  """The module docstring of objectives.py, written out in float64."""
  targets = batch["targets"]
  real = targets >= 0
  logp = np_logprobs(logits, targets, rl.temperature, rl.top_k)
  ratio = np.exp(logp - batch["behavior_logprobs"])
  adv = batch["advantages"].astype(np.float64)
  pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - rl.clip_low, 1 + rl.clip_high) * adv)
  clipped = ((adv > 0) & (ratio > 1 + rl.clip_high)) | ((adv < 0) & (ratio < 1 - rl.clip_low))
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  z = z_loss * log_z**2
  kl = np.zeros_like(pg)
  if ref_logits is not None:
    # A target outside the reference's top-k: -inf, clamped as objectives.KL_CLAMP says.
    d = np.clip(np_logprobs(ref_logits, targets, rl.temperature, rl.top_k) - logp, -20, 20)
    kl = np.exp(d) - d - 1
  mismatch = np.abs(batch["behavior_logprobs"] - logp)
  s = lambda x: float(np.sum(np.where(real, x, 0.0)))
  total = s(pg) + rl.kl_coef * s(kl) + s(z)
  return total, {
    "pg_sum": s(pg),
    "kl_sum": s(kl),
    "z_sum": s(z),
    "clipped": s(clipped.astype(np.float64)),
    "ratio_sum": s(ratio),
    "mismatch_sum": s(mismatch),
    "mismatch_max": float(np.max(np.where(real, mismatch, 0.0))),
    "tokens": float(real.sum()),
  }


def make_case(rl, seed=0):
  """Random logits and a batch whose behaviour log-probs are the trainer's moved by up to ±0.6
  (ratios from 0.55 to 1.8: clipped below and above), with masked prompt and padding tokens."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(B, L, V)).astype(np.float32) * 2
  # Targets drawn among each position's top 5 (in the top-k support when top_k=5).
  top5 = np.argsort(-logits, axis=-1)[..., :5]
  targets = np.take_along_axis(top5, rng.integers(0, 5, (B, L, 1)), -1)[..., 0]
  targets[:, :2] = -1  # the prompt
  targets[1, -2:] = -1  # padding
  logp = np_logprobs(logits, targets, rl.temperature, rl.top_k)
  behavior = (logp + rng.uniform(-0.6, 0.6, (B, L))).astype(np.float32)
  behavior[targets < 0] = 123.0  # what a padded position holds must not matter
  advantages = np.repeat(rng.normal(size=(B, 1)), L, axis=1).astype(np.float32)
  advantages[2] = 0.0  # a zero-variance group's sequence
  batch = {"targets": targets.astype(np.int32), "advantages": advantages}
  batch["behavior_logprobs"] = behavior
  return logits, batch


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_grpo_loss_matches_numpy(top_k, kl_coef):
  rl = rl_config(top_k=top_k, kl_coef=kl_coef)
  logits, batch = make_case(rl)
  ref_logits = logits + np.random.default_rng(1).normal(size=logits.shape).astype(np.float32)
  objective = objectives.GRPO(1e-3, rl)
  ref = ref_logits if kl_coef else None
  total, stats = jax.jit(objective.loss)(logits, batch, ref)
  want_total, want = np_grpo(logits, batch, rl, 1e-3, ref)
  # Both sides of the clip happen, and masked tokens are left out.
  assert 0 < want["clipped"] < want["tokens"] < B * L
  assert_close(total, want_total, "total")
  for key, value in want.items():
    assert_close(stats[key], value, key, tol=1e-5)
  if kl_coef:
    assert 0 < want["kl_sum"] < np.inf


def test_clipped_and_masked_tokens_carry_no_gradient():
  rl = rl_config(top_k=5)
  logits, batch = make_case(rl)
  objective = objectives.GRPO(0.0, rl)  # no z-loss: only the policy gradient
  grads = jax.grad(lambda x: objective.loss(x, batch)[0])(jnp.asarray(logits))
  per_token = np.abs(np.asarray(grads)).sum(-1)
  logp = np_logprobs(logits, batch["targets"], rl.temperature, rl.top_k)
  ratio = np.exp(logp - batch["behavior_logprobs"])
  adv = batch["advantages"]
  clipped = ((adv > 0) & (ratio > 1 + rl.clip_high)) | ((adv < 0) & (ratio < 1 - rl.clip_low))
  masked = batch["targets"] < 0
  silent = clipped | masked | (adv == 0)
  assert clipped.any() and masked.any()
  np.testing.assert_array_equal(per_token[silent], 0.0)
  assert (per_token[~silent] > 0).all()


def test_merge_adds_sums_and_maxes_the_mismatch_max():
  objective = objectives.GRPO(0.0, rl_config())
  a = {k: jnp.float32(1.0) for k in objective.stat_keys}
  b = {k: jnp.float32(3.0) for k in objective.stat_keys}
  merged = objective.merge_all([a, b, a])
  assert float(merged["mismatch_max"]) == 3.0
  assert float(merged["tokens"]) == 5.0


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"train.objective": "ppo"}, "train.objective='ppo' is not an objective; valid: lm, grpo"),
    ({"rl.temperature": 0.0}, "rl.temperature=0.0 must be > 0"),
    ({"rl.top_k": -1}, "rl.top_k=-1 must be an integer >= 0"),
    ({"rl.top_p": 0.0}, "rl.top_p=0.0 must be in (0, 1]"),
    ({"rl.clip_low": 1.0}, "rl.clip_low=1.0 must be in [0, 1)"),
    ({"rl.clip_high": -0.1}, "rl.clip_high=-0.1 must be >= 0"),
    ({"rl.kl_coef": -1.0}, "rl.kl_coef=-1.0 must be >= 0"),
    ({"train.eval_every": 5}, "train.eval_every=5 evaluates the LM loss"),
  ],
)
def test_bad_grpo_settings_are_one_line(overrides, message):
  config = tiny_test_config(**{"train.objective": "grpo", "train.eval_every": 0, **overrides})
  with pytest.raises(ConfigError) as refused:
    config_lib.validate(config)
  assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
