"""Optimizers and learning-rate schedules from the config.

Adafactor as PaLM trained with it: no factorisation (so it is Adam with parameter scaling),
beta1 = 0.9, beta2 = 1 - step^-0.8, global-norm clipping at 1.0, learning rate 1e-2 held for 10k
steps then decayed as 1/sqrt(step), and weight decay lr(t)^2 * param. AdamW with a cosine schedule
is the alternative; SGD with momentum (same schedule as Adafactor) is the plain baseline, and the
optimizer whose update is linear in the gradient (what the parity tests rely on). Any optimizer
takes any `optim.schedule` (see `schedule_for`); "auto" keeps each optimizer's own recipe.
"""

import jax
import jax.numpy as jnp
import optax

from pwtrain.errors import ConfigError

OPTIMIZERS = ("adafactor", "adamw", "sgd")


SCHEDULES = ("auto", "rsqrt", "cosine", "linear", "wsd", "constant")


def palm_schedule(lr: float, warmup_steps: int, constant_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, constant until `constant_steps`, then lr * sqrt(constant_steps/t)."""

  def schedule(count):
    t = jnp.asarray(count, jnp.float32) + 1.0
    warm = jnp.minimum(1.0, t / max(warmup_steps, 1))
    decay = jnp.sqrt(constant_steps / jnp.maximum(t, constant_steps))
    return lr * warm * decay

  return schedule


def schedule_for(optim_cfg, num_steps: int) -> optax.Schedule:
  """The learning rate at optimizer step `count` (0-based) for `optim.schedule`:
  rsqrt     PaLM: linear warmup over `warmup_steps` to `lr`, constant until `constant_steps`,
            then lr * sqrt(constant_steps / t) (t = count + 1)
  cosine    warmup from 0 to `lr`, then a cosine down to lr * end_lr_fraction at num_steps
  linear    warmup from 0 to `lr`, then linearly down to lr * end_lr_fraction at num_steps
  wsd       warmup-stable-decay: warmup from 0 to `lr`, constant, then linearly down to
            lr * end_lr_fraction over the last `decay_fraction` of num_steps
  constant  warmup from 0 to `lr`, then constant
  auto      the optimizer's own recipe: rsqrt for adafactor and sgd, cosine for adamw
  """
  name, lr, warmup = optim_cfg.schedule, optim_cfg.lr, optim_cfg.warmup_steps
  if name == "auto":
    name = "cosine" if optim_cfg.name == "adamw" else "rsqrt"
  end = lr * optim_cfg.end_lr_fraction
  if name == "rsqrt":
    return palm_schedule(lr, warmup, optim_cfg.constant_steps)
  if name == "cosine":
    return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=lr,
      warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1),
      end_value=end,
    )
  if name == "constant":
    return _warmup_then(lr, warmup, optax.constant_schedule(lr))
  if name == "linear":
    decay = optax.linear_schedule(lr, end, max(num_steps - warmup, 1))
    return _warmup_then(lr, warmup, decay)
  if name == "wsd":
    decay_steps = max(int(round(optim_cfg.decay_fraction * num_steps)), 1)
    stable = max(num_steps - warmup - decay_steps, 0)
    decay = optax.join_schedules(
      [optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay_steps)], [stable]
    )
    return _warmup_then(lr, warmup, decay)
  raise ConfigError(f"optim.schedule={name!r} is not a schedule; valid: {', '.join(SCHEDULES)}")


def _warmup_then(lr: float, warmup_steps: int, after: optax.Schedule) -> optax.Schedule:
  """Linear warmup from 0 to `lr` over `warmup_steps`, then `after` (counted from its end)."""
  if warmup_steps == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def clip_by_global_norm(grads, norm, max_norm: float):
  """Scales grads to global norm <= max_norm, given the norm (as optax.clip_by_global_norm).

  The norm is an input, not computed here, because under pipelining it spans every stage's
  gradients while each stage updates only its own.
  """
  return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm), grads)


def build(optim_cfg, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns (optimizer, learning-rate schedule) for `config.optim`.

  Global-norm clipping (optim.clip_norm) is not part of the returned transformation: the step
  applies it with `clip_by_global_norm`, from a norm it may have gathered across stages.
  """
  name = optim_cfg.name
  schedule = schedule_for(optim_cfg, num_steps)
  if name == "adafactor":
    wd = optim_cfg.weight_decay
    tx = optax.chain(
      optax.scale_by_factored_rms(factored=False, decay_rate=optim_cfg.decay_rate),
      optax.scale_by_learning_rate(schedule, flip_sign=False),
      optax.scale_by_param_block_rms(),
      optax.ema(optim_cfg.b1, debias=False),
      # Added after the lr scaling, so the decay applied is wd * lr(t)^2 * param (PaLM).
      optax.add_decayed_weights(lambda count: wd * schedule(count) ** 2),
      optax.scale(-1.0),
    )
    return tx, schedule
  if name == "adamw":
    tx = optax.adamw(
      schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, weight_decay=optim_cfg.weight_decay
    )
    return tx, schedule
  if name == "sgd":
    tx = optax.sgd(schedule, momentum=optim_cfg.b1)
    return tx, schedule
  raise ConfigError(f"optim.name={name!r} is not an optimizer; valid: {', '.join(OPTIMIZERS)}")
