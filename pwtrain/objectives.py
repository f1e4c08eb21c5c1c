"""What a training step minimises (`train.objective`): one `Objective` per run, used by every
layout (step.py and parallel/spmd.py on one island, the pipeline's last stage, the pods'
exchange), so none of them names a batch column, a loss or a statistic of its own.

An objective says
  columns      the batch's arrays ([train.global_batch, data.seq_len] each) and their dtypes:
               "inputs" (token ids, fed to the model) and its label columns
  loss         (logits, labels[, reference logits]) -> (the summed loss, its statistics); the
               logits are the model's of the inputs, `labels` the label columns of the same rows
  zero_stats   the statistics of no rows
  merge        two partial statistics (microbatches, data shards, pods) combined: sums added,
               `max_keys` by their maximum, so that any split of the batch gives the same total
  metrics      the step's metrics from its total statistics (per-token means over `tokens`)
The statistics are sums (and maxima) over tokens, never means, so that microbatches, shards and
pods combine exactly; "loss_sum" (what is differentiated, MoE aux losses included) is added by
the step, the others by `loss`.

`LanguageModeling` ("lm"): next-token cross-entropy plus z-loss (models.lm_loss).
`GRPO` ("grpo", Shao et al. 2024), per completion token t of a sampled sequence with advantage A:
  logp       log-prob of the target (the sampled token) under the distribution the sampler drew
             from: softmax(models.sampling.sampled_logits(logits, rl.temperature, rl.top_k,
             rl.top_p, num_tokens)), the same function as the sampler's; `num_tokens`, the
             run's tokenizer's ids (an argument of `make`, from the tokenizer the run opened),
             cuts the ids of a padded vocabulary as the sampler does
  ratio      exp(logp - behavior_logprobs), the sampler's log-prob recorded at generation
  pg         -min(ratio A, clip(ratio, 1 - rl.clip_low, 1 + rl.clip_high) A)
  kl         (rl.kl_coef > 0) k3 to the frozen reference policy (the train state's "reference"
             params): exp(d) - d - 1 with d = ref_logp - logp, d clamped to [-20, 20]
  loss       sum over tokens of pg + rl.kl_coef kl, plus the model's z-loss
             (model.z_loss log Z^2 of the raw logits), divided by the batch's token count: a
             token-level mean over the global batch
A negative target is no token (prompt and padding): no loss, no statistic. Metrics: loss,
pg_loss, kl, z_loss, clip_fraction (tokens whose ratio is clipped: no gradient),
ratio_mean, logprob_mismatch_mean and logprob_mismatch_max (|behavior_logprobs - logp|), tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pwtrain.errors import ConfigError
from pwtrain.models import lm_loss
from pwtrain.models.sampling import sampled_logits

OBJECTIVES = ("lm", "grpo")
KL_CLAMP = 20.0  # |ref_logp - logp| beyond it counts as this much in the k3 estimator


class LanguageModeling:
  """Next-token prediction: cross-entropy of `targets` plus z-loss."""

  name = "lm"
  columns = {"inputs": np.int32, "targets": np.int32}
  stat_keys = ("loss_sum", "ce_sum", "z_sum", "tokens")
  max_keys: tuple = ()  # statistics combined by their maximum
  holds_reference = False  # the train state holds the reference policy ("reference")
  temperature, top_k, top_p = 1.0, 0, 1.0  # the distribution `logprobs` reads: the model's
  num_tokens: int | None = None  # ids at or above it cut (None: none)

  def __init__(self, z_loss: float):
    self.z_loss = z_loss

  @property
  def label_columns(self) -> tuple[str, ...]:
    """The columns `loss` reads, in this order (all but "inputs")."""
    return tuple(k for k in self.columns if k != "inputs")

  def logprobs(self, logits, targets):
    """[b, L] log-probs of `targets` under the objective's distribution (GRPO: the sampled
    one), 0 where the target is negative (no token)."""
    real = targets >= 0
    logp_all = jax.nn.log_softmax(
      sampled_logits(logits, self.temperature, self.top_k, self.top_p, self.num_tokens), axis=-1
    )
    safe = jnp.where(real, targets, 0)
    logp = jnp.take_along_axis(logp_all, safe[..., None], axis=-1)[..., 0]
    return jnp.where(real, logp, 0.0)

  def loss(self, logits, labels: dict, reference_logits=None):
    """(summed loss, {"ce_sum", "z_sum", "tokens"}) of `logits` [b, L, vocab] for `labels`."""
    del reference_logits
    return lm_loss(logits, labels["targets"], z_loss=self.z_loss)

  def zero_stats(self) -> dict:
    return {k: jnp.zeros((), jnp.float32) for k in self.stat_keys}

  def merge(self, a: dict, b: dict) -> dict:
    """Two partial statistics combined (any other keys, MoE's, added)."""
    return {k: jnp.maximum(a[k], b[k]) if k in self.max_keys else a[k] + b[k] for k in a}

  def merge_all(self, parts: list[dict]) -> dict:
    """Partial statistics merged in list order (pod order: bitwise equal everywhere)."""
    total = parts[0]
    for part in parts[1:]:
      total = self.merge(total, part)
    return total

  def metrics(self, stats: dict) -> dict:
    tokens = jnp.maximum(stats["tokens"], 1.0)
    return {
      "loss": stats["loss_sum"] / tokens,
      "ce_loss": stats["ce_sum"] / tokens,
      "z_loss": stats["z_sum"] / tokens,
      "tokens": stats["tokens"],
    }


class GRPO(LanguageModeling):
  """The clipped importance-ratio policy gradient of the module docstring."""

  name = "grpo"
  columns = {
    "inputs": np.int32,
    "targets": np.int32,
    "advantages": np.float32,
    "behavior_logprobs": np.float32,
  }
  stat_keys = (
    "loss_sum",
    "pg_sum",
    "kl_sum",
    "z_sum",
    "clipped",
    "ratio_sum",
    "mismatch_sum",
    "mismatch_max",
    "tokens",
  )
  max_keys = ("mismatch_max",)

  def __init__(self, z_loss: float, rl, num_tokens: int | None = None):
    """`num_tokens`: the sampler's (the run's tokenizer's ids); None: every id."""
    super().__init__(z_loss)
    self.temperature, self.top_k, self.top_p = rl.temperature, rl.top_k, rl.top_p
    self.clip_low, self.clip_high, self.kl_coef = rl.clip_low, rl.clip_high, rl.kl_coef
    self.num_tokens = num_tokens  # ids at or above it are never drawn: cut here too
    self.holds_reference = rl.kl_coef > 0

  def loss(self, logits, labels: dict, reference_logits=None):
    targets, advantages = labels["targets"], labels["advantages"]
    real = targets >= 0
    weights = real.astype(jnp.float32)
    logp = self.logprobs(logits, targets)
    behavior = jnp.where(real, labels["behavior_logprobs"], 0.0)
    ratio = jnp.exp(logp - behavior)
    clipped_ratio = jnp.clip(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
    pg = -jnp.minimum(ratio * advantages, clipped_ratio * advantages) * weights
    # Tokens whose ratio is past the clip on the side their advantage pushes: no gradient.
    clipped = ((advantages > 0) & (ratio > 1.0 + self.clip_high)) | (
      (advantages < 0) & (ratio < 1.0 - self.clip_low)
    )
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    z = self.z_loss * jnp.square(log_z) * weights
    total = jnp.sum(pg) + jnp.sum(z)
    stats = {"pg_sum": jnp.sum(pg), "z_sum": jnp.sum(z)}
    if reference_logits is not None:
      d = jnp.clip(self.logprobs(reference_logits, targets) - logp, -KL_CLAMP, KL_CLAMP)
      kl = (jnp.exp(d) - d - 1.0) * weights
      stats["kl_sum"] = jnp.sum(kl)
      total = total + self.kl_coef * stats["kl_sum"]
    else:
      stats["kl_sum"] = jnp.zeros((), jnp.float32)
    mismatch = jax.lax.stop_gradient(jnp.abs(behavior - logp) * weights)
    stats.update(
      clipped=jnp.sum(clipped & real, dtype=jnp.float32),
      ratio_sum=jax.lax.stop_gradient(jnp.sum(ratio * weights)),
      mismatch_sum=jnp.sum(mismatch),
      mismatch_max=jnp.max(mismatch, initial=0.0),
      tokens=jnp.sum(weights),
    )
    return total, stats

  def metrics(self, stats: dict) -> dict:
    tokens = jnp.maximum(stats["tokens"], 1.0)
    return {
      "loss": stats["loss_sum"] / tokens,
      "pg_loss": stats["pg_sum"] / tokens,
      "kl": stats["kl_sum"] / tokens,
      "z_loss": stats["z_sum"] / tokens,
      "clip_fraction": stats["clipped"] / tokens,
      "ratio_mean": stats["ratio_sum"] / tokens,
      "logprob_mismatch_mean": stats["mismatch_sum"] / tokens,
      "logprob_mismatch_max": stats["mismatch_max"],
      "tokens": stats["tokens"],
    }


def make(config, num_tokens: int | None = None) -> LanguageModeling:
  """The run's objective (`train.objective`). `num_tokens` (GRPO's): the ids of the tokenizer
  the run samples with, which its sampler never draws past; the run derives it once from the
  tokenizer it opened (train.py) and passes the objective on (Harness.build). None: every id.
  It changes only the log-probs, so `make(config)` has the run's columns, statistics and
  reference (what the layouts' exchanges and the checkpoints read)."""
  if config.train.objective == "grpo":
    return GRPO(config.model.z_loss, config.rl, num_tokens)
  return LanguageModeling(config.model.z_loss)


def holds_reference(config) -> bool:
  """Whether the run's train state holds the reference policy's params ("reference")."""
  return make(config).holds_reference


def validate(config) -> None:
  """Errors for `train.objective` and the `rl.*` settings the objective reads."""
  objective = config.train.objective
  if objective not in OBJECTIVES:
    raise ConfigError(
      f"train.objective={objective!r} is not an objective; valid: {', '.join(OBJECTIVES)}"
    )
  if objective != "grpo":
    return
  rl = config.rl
  if not rl.temperature > 0:
    raise ConfigError(
      f"rl.temperature={rl.temperature!r} must be > 0: GRPO's ratio needs the sampled "
      "distribution's log-probabilities (greedy has none)"
    )
  if not isinstance(rl.top_k, int) or rl.top_k < 0:
    raise ConfigError(f"rl.top_k={rl.top_k!r} must be an integer >= 0 (0: off)")
  if not 0 < rl.top_p <= 1:
    raise ConfigError(f"rl.top_p={rl.top_p!r} must be in (0, 1] (1: off)")
  if not 0 <= rl.clip_low < 1:
    raise ConfigError(f"rl.clip_low={rl.clip_low!r} must be in [0, 1)")
  for key in ("clip_high", "kl_coef"):
    if not rl[key] >= 0:
      raise ConfigError(f"rl.{key}={rl[key]!r} must be >= 0")
  if config.train.eval_every:
    raise ConfigError(
      f"train.eval_every={config.train.eval_every} evaluates the LM loss on data.eval_split, "
      "which train.objective='grpo' does not train on: set train.eval_every=0"
    )
  cells = config.parallel.stages > 1 or (
    config.parallel.pods > 1 and config.exchange.mode == "overlapped"
  )
  if rl.kl_coef > 0 and cells:
    raise ConfigError(
      f"rl.kl_coef={rl.kl_coef} needs the reference policy's logits next to the policy's, which "
      "a model cut into cells (parallel.stages > 1, or exchange.mode='overlapped') does not "
      "compute: set rl.kl_coef=0, or parallel.stages=1 with exchange.mode='sync'"
    )
