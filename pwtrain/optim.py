"""Optimizers and learning-rate schedules from the config.

Adafactor as PaLM trained with it: no factorisation (so it is Adam with parameter scaling),
beta1 = 0.9, beta2 = 1 - step^-0.8, global-norm clipping at 1.0, learning rate 1e-2 held for 10k
steps then decayed as 1/sqrt(step), and weight decay lr(t)^2 * param. AdamW with a cosine schedule
is the alternative; SGD with momentum (same schedule as Adafactor) is the plain baseline, and the
optimizer whose update is linear in the gradient (what the parity tests rely on).
"""

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("adafactor", "adamw", "sgd")


def palm_schedule(lr: float, warmup_steps: int, constant_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, constant until `constant_steps`, then lr * sqrt(constant_steps/t)."""

  def schedule(count):
    t = jnp.asarray(count, jnp.float32) + 1.0
    warm = jnp.minimum(1.0, t / max(warmup_steps, 1))
    decay = jnp.sqrt(constant_steps / jnp.maximum(t, constant_steps))
    return lr * warm * decay

  return schedule


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
  if name == "adafactor":
    schedule = palm_schedule(optim_cfg.lr, optim_cfg.warmup_steps, optim_cfg.constant_steps)
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
    schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=optim_cfg.lr,
      warmup_steps=optim_cfg.warmup_steps,
      decay_steps=max(num_steps, optim_cfg.warmup_steps + 1),
      end_value=optim_cfg.lr * optim_cfg.end_lr_fraction,
    )
    tx = optax.adamw(
      schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, weight_decay=optim_cfg.weight_decay
    )
    return tx, schedule
  if name == "sgd":
    schedule = palm_schedule(optim_cfg.lr, optim_cfg.warmup_steps, optim_cfg.constant_steps)
    tx = optax.sgd(schedule, momentum=optim_cfg.b1)
    return tx, schedule
  raise ValueError(f"optim.name={name!r} is not an optimizer; valid: {', '.join(OPTIMIZERS)}")
