"""Learning-rate schedules and PaLM's Adafactor, at chosen steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_config

from pwtrain import config as config_lib
from pwtrain import optim


def cfg(schedule, **overrides):
  c = load_config("palm_tiny").optim
  c.schedule = schedule
  c.warmup_steps = 10
  for key, value in overrides.items():
    c[key] = value
  return c


def lr_at(c, num_steps, steps):
  schedule = optim.schedule_for(c, num_steps)
  return [float(schedule(s)) for s in steps]


def test_palm_rsqrt_schedule():
  """PaLM: 1e-2 until step 10k, then 1e-2 * sqrt(10k / step) (steps counted from 1)."""
  c = cfg("rsqrt", lr=1e-2, warmup_steps=0, constant_steps=10_000)
  got = lr_at(c, 100_000, [0, 4_999, 9_999, 19_999, 39_999, 99_999])
  want = [1e-2, 1e-2, 1e-2, 1e-2 * np.sqrt(0.5), 1e-2 * 0.5, 1e-2 * np.sqrt(0.1)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_rsqrt_warms_up_linearly():
  c = cfg("rsqrt", lr=1e-2, constant_steps=10_000)
  np.testing.assert_allclose(lr_at(c, 1000, [0, 4, 9, 50]), [1e-3, 5e-3, 1e-2, 1e-2], rtol=1e-6)


@pytest.mark.parametrize(
  ("schedule", "want"),
  [
    # steps:        0 (start) 5 (warmup)  10 (peak)  55 (middle)  100 (end)
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.55, 0.1]),
    ("cosine", [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1]),
    # wsd: decays over the last 20 steps (80 -> 100); stable until then.
    ("wsd", [0.0, 0.5, 1.0, 1.0, 0.1]),
  ],
)
def test_schedules_at_chosen_steps(schedule, want):
  c = cfg(schedule, lr=1.0, end_lr_fraction=0.1, decay_fraction=0.2)
  np.testing.assert_allclose(lr_at(c, 100, [0, 5, 10, 55, 100]), want, rtol=1e-6, atol=1e-7)


def test_wsd_decays_only_at_the_end():
  c = cfg("wsd", lr=1.0, end_lr_fraction=0.0, decay_fraction=0.2)
  np.testing.assert_allclose(lr_at(c, 100, [79, 80, 90, 100]), [1.0, 1.0, 0.5, 0.0], atol=1e-6)


def test_auto_keeps_each_optimizers_recipe():
  adamw = cfg("auto", name="adamw", lr=1.0, end_lr_fraction=0.1)
  cosine = cfg("cosine", name="adamw", lr=1.0, end_lr_fraction=0.1)
  assert lr_at(adamw, 100, [5, 55, 99]) == lr_at(cosine, 100, [5, 55, 99])
  ada = cfg("auto", name="adafactor", lr=1e-2, constant_steps=20)
  rsqrt = cfg("rsqrt", name="adafactor", lr=1e-2, constant_steps=20)
  assert lr_at(ada, 100, [5, 55, 99]) == lr_at(rsqrt, 100, [5, 55, 99])


def test_a_bad_schedule_names_the_key():
  c = load_config("palm_tiny")
  c.optim.schedule = "step"
  with pytest.raises(ValueError, match="optim.schedule='step' is not a schedule; valid: auto"):
    config_lib.validate(c)


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_every_optimizer_takes_every_schedule(name):
  for schedule in optim.SCHEDULES:
    tx, sched = optim.build(cfg(schedule, name=name), 100)
    params = {"w": jnp.ones((3, 2))}
    updates, _ = tx.update({"w": jnp.full((3, 2), 0.5)}, tx.init(params), params)
    assert np.all(np.isfinite(updates["w"])) and float(sched(50)) > 0


def test_palm_adafactor_beta2_and_decay():
  """beta2 = 1 - t^-0.8 (t from 1) and weight decay lr(t)^2 * param, as in PaLM."""
  c = cfg("rsqrt", name="adafactor", lr=1e-2, warmup_steps=0, constant_steps=10_000)
  c.weight_decay = 1.0
  tx, schedule = optim.build(c, 100)
  params = {"w": jnp.full((4,), 2.0)}
  state = tx.init(params)
  # Zero gradients: the update is the decay alone, -wd * lr^2 * param.
  zeros = {"w": jnp.zeros((4,))}
  updates, _ = tx.update(zeros, state, params)
  np.testing.assert_allclose(updates["w"], -1.0 * 1e-4 * 2.0, rtol=1e-6)
  # Second moments after gradients g1, g2: v2 = b2(2) * g1^2 + (1 - b2(2)) * g2^2, b2(1) = 0.
  g1, g2 = {"w": jnp.full((4,), 3.0)}, {"w": jnp.full((4,), 1.0)}
  _, state = tx.update(g1, state, params)
  _, state = tx.update(g2, state, params)
  b2 = 1 - 2.0**-0.8
  v = jax.tree.leaves(state[0])[-1]  # scale_by_factored_rms's unfactored second moment
  np.testing.assert_allclose(v, b2 * 9.0 + (1 - b2) * 1.0, rtol=1e-5)
