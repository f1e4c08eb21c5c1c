"""`stale`: step t applies the all-pod gradient sum of step t-1, so the exchange has a step.

The sum of step t-1 was computed at the parameters of step t-1. The first step has nothing to
apply and leaves parameters and optimizer state as they are. Pods stay identical. Numerics:
after step t+1 the parameters equal the sync run's after step t (same batches, constant
learning rate); in general it is SGD with a one-step gradient delay.
"""

import jax
import jax.numpy as jnp

from pwtrain.models import moe as moe_lib
from pwtrain.parallel.exchange.sync import Sync


class Stale(Sync):
  mode = "stale"

  def __init__(self, config):
    super().__init__(config)
    self.num_experts = config.moe.num_experts

  def init_state(self, params) -> dict:
    """Last step's summed gradients, stats and squared norm (nothing yet: tokens = 0)."""
    pending = {
      "grads": jax.tree.map(jnp.zeros_like, params),
      "stats": self.objective.zero_stats() | moe_lib.zero_stats(self.num_experts),
      "sumsq": jnp.zeros((), jnp.float32),
    }
    return {**super().init_state(params), "pending": pending}

  def wrap_update(self, update):
    """Applies last step's sum; the metrics describe the current step (its loss and norm)."""

    def fn(state, grads, stats, sumsq):
      pending = state["pending"]
      base = {k: v for k, v in state.items() if k != "pending"}
      new, _ = update(base, pending["grads"], pending["stats"], pending["sumsq"])
      ready = pending["stats"]["tokens"] > 0
      for key in ("params", "opt_state"):
        new[key] = jax.tree.map(lambda a, b: jnp.where(ready, a, b), new[key], base[key])
      new["pending"] = {"grads": grads, "stats": stats, "sumsq": sumsq}
      # Metrics of the current step; XLA drops the rest of this second update as dead code.
      _, metrics = update(base, grads, stats, sumsq)
      return new, metrics

    return fn

  def exposed_s(self, transfer_s, compute_s, num_layers):
    del num_layers
    return None if compute_s is None else max(0.0, transfer_s - compute_s)
