"""Loss spikes and non-finite steps: skip the update in the compiled step, roll back on the host.

PaLM (Chowdhery et al., 2022, section 5.1) saw loss spikes that came from particular batches
meeting particular parameter states; they restarted from a checkpoint about 100 steps before the
spike and skipped the batches around it. pwtrain does the cheap half of that inside the step and
the rest in the trainer:

- `skip_nonfinite` wraps an update function (step.apply_update and its wrappers): when the
  step's loss or gradient norm is NaN/Inf, the parameters and optimizer state are kept as they
  were and the metric "skipped" is 1. The step counter still advances, because the batch was
  consumed. Every piece of a pipelined or multi-pod step decides from the same global loss and
  norm, so all stages and pods skip together.
- `SpikeMonitor` reads the logged metrics (fetched every train.log_every steps, so watching costs
  no extra synchronisation) and asks for a rollback after train.rollback_after consecutive
  skipped steps; the trainer then restores the last checkpoint from before the streak and goes
  on with the data iterator where it is, so the batches that led into the spike are not seen
  again.
"""

import jax
import jax.numpy as jnp


def skip_nonfinite(update):
  """(state, grads, stats, sumsq=None) -> (state, metrics) that skips non-finite steps."""

  def fn(state, grads, stats, sumsq=None):
    new, metrics = update(state, grads, stats, sumsq)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    new = dict(new)
    for key in ("params", "opt_state"):
      new[key] = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new[key], state[key])
    return new, {**metrics, "skipped": jnp.where(ok, 0.0, 1.0)}

  return fn


def wrap_update(update, train_cfg):
  return skip_nonfinite(update) if train_cfg.skip_nonfinite else update


class Diverged(RuntimeError):
  """Training kept producing non-finite steps after train.max_rollbacks rollbacks."""


class SpikeMonitor:
  """Counts consecutive skipped steps in the logged history; says when to roll back."""

  def __init__(self, rollback_after: int, max_rollbacks: int):
    self.rollback_after = rollback_after
    self.max_rollbacks = max_rollbacks
    self.rollbacks = 0
    self._seen = 0  # rows of the history already looked at
    self._streak: list[int] = []  # steps of the current run of skipped steps

  def observe(self, history: list[dict]) -> int | None:
    """The first step of a streak long enough to roll back over, else None."""
    rows, self._seen = history[self._seen :], len(history)
    for row in rows:
      if row.get("skipped", 0.0) > 0:
        self._streak.append(row["step"])
      else:
        self._streak = []
      if self.rollback_after and len(self._streak) >= self.rollback_after:
        first = self._streak[0]
        self._streak = []
        self.rollbacks += 1
        if self.rollbacks > self.max_rollbacks:
          raise Diverged(
            f"{self.rollback_after} consecutive non-finite steps from step {first} after "
            f"train.max_rollbacks={self.max_rollbacks} rollbacks; the checkpoints are intact "
            "(lower optim.lr or raise train.rollback_skip_batches and resume)"
          )
        return first
    return None
