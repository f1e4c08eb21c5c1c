"""Autoregressive generation: the next-token rule (temperature, top-k, nucleus) and the loop
that runs it over the KV-cache forward (decode.py).

The rule, on a row's float32 logits over the vocabulary:
  temperature == 0   greedy: the argmax (the lowest id among equal maxima); top_k, top_p unused
  otherwise          a draw from softmax(logits / temperature) restricted, in this order, to
    top_k > 0        the ids whose logit is >= the top_k-th largest (ties at the cut are kept)
    top_p < 1        the nucleus of what is left: the most probable ids, in decreasing
                     probability, up to and including the first at which the cumulative
                     probability (renormalised after top_k) reaches top_p, ties at the cut
                     kept; never empty
Ids >= `num_tokens` (a vocabulary padded past the tokenizer's) are never produced. `pick` is the
rule with settings per row (arrays), as a serving batch needs, each row drawing with its own
key; `next_token` is the rule with one setting for every row.

The loop (`generate`) prefills the prompts in one forward pass, then feeds back one token at a
time inside a `jax.lax.while_loop`, so the whole generation is one traced function the caller
jits. Step t's randomness is `jax.random.fold_in(key, t)`; rows draw independently from it.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pwtrain.errors import ConfigError
from pwtrain.models import decode
from pwtrain.models.palm import PaLM


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is picked (module docstring); hashable, so it can be a static arg."""

  temperature: float = 1.0
  top_k: int = 0  # 0: no top-k cut
  top_p: float = 1.0  # 1: no nucleus cut

  def __post_init__(self):
    if self.temperature < 0:
      raise ConfigError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
    if self.top_k < 0:
      raise ConfigError(f"top_k={self.top_k} must be >= 0 (0: off)")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1: off)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generated:
  """`tokens` [b, max_new_tokens]: each row's new tokens, ending with EOS if the row stopped
  at it (counted in `lengths`), then pad_id; `lengths` [b]: how many each row generated."""

  tokens: jax.Array
  lengths: jax.Array


def next_token(logits, key, sampling: Sampling, num_tokens: int | None = None):
  """logits [b, vocab] -> [b] int32 ids by the module docstring's rule, one `sampling` for every
  row, all rows drawing from `key`."""
  return pick(logits, key, sampling.temperature, sampling.top_k, sampling.top_p, num_tokens)


def sampled_logits(logits, temperature, top_k, top_p, num_tokens: int | None = None):
  """logits [..., vocab] -> the float32 logits of the distribution a draw uses (the module
  docstring's rule for temperature > 0): divided by the temperature, the ids that top_k, top_p
  and `num_tokens` cut set to float32's lowest, so that a softmax (or log-softmax) of them is the
  distribution sampled. `temperature`, `top_k`, `top_p`: each a Python number (every row's) or
  an array of the leading dims (per row); a temperature of 0 divides by 1. A Python number that
  turns a cut off leaves it out of the program. The sampler's `pick` and the trainer's GRPO
  log-probabilities (objectives.py) both use this function, so the two run the same code."""
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  lead = logits.shape[:-1]
  neg_inf = jnp.finfo(jnp.float32).min
  if num_tokens is not None and num_tokens < vocab:
    logits = jnp.where(jnp.arange(vocab) < num_tokens, logits, neg_inf)
  per_row = lambda value, dtype: jnp.broadcast_to(jnp.asarray(value, dtype), lead)[..., None]
  if not (_static(temperature) and temperature in (0, 1)):
    t = per_row(temperature, jnp.float32)
    logits = logits / jnp.where(t > 0, t, 1.0)
  if not (_static(top_k) and not 0 < top_k < vocab):
    k = per_row(top_k, jnp.int32)
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, jnp.clip(k - 1, 0, vocab - 1), axis=-1)
    logits = jnp.where((0 < k) & (k < vocab) & (logits < kth), neg_inf, logits)
  if not (_static(top_p) and top_p >= 1):
    p = per_row(top_p, jnp.float32)
    descending = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more probable ids
    # The least probable id kept; the first (most probable) always is.
    cut = jnp.min(jnp.where(before < p, descending, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where((p < 1) & (logits < cut), neg_inf, logits)
  return logits


def pick(logits, keys, temperature, top_k, top_p, num_tokens: int | None = None):
  """logits [b, vocab] -> [b] int32 ids by the module docstring's rule, with `temperature`,
  `top_k` and `top_p` each a Python number (every row's) or a [b] array (per row; validated by
  the caller). `keys`: one key that all rows draw from, or [b] keys, one per row. A Python
  number that turns a stage off leaves it out of the program (greedy alone is an argmax). The
  draw is from `sampled_logits`."""
  logits = logits.astype(jnp.float32)
  num_rows, vocab = logits.shape
  if num_tokens is not None and num_tokens < vocab:
    masked = jnp.where(jnp.arange(vocab) < num_tokens, logits, jnp.finfo(jnp.float32).min)
  else:
    masked = logits
  greedy = jnp.argmax(masked, axis=-1).astype(jnp.int32)
  if _static(temperature) and temperature == 0:
    return greedy
  logits = sampled_logits(logits, temperature, top_k, top_p, num_tokens)
  if keys.ndim:  # one key per row
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, logits)
  else:
    drawn = jax.random.categorical(keys, logits, axis=-1)
  temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (num_rows,))
  return jnp.where(temperature == 0, greedy, drawn.astype(jnp.int32))


def _static(value) -> bool:
  return isinstance(value, int | float)


def generate(
  model: PaLM,
  prompts,
  prompt_lengths,
  key,
  *,
  max_new_tokens: int,
  sampling: Sampling,
  eos_id: int | None = None,
  pad_id: int = 0,
  num_tokens: int | None = None,
) -> Generated:
  """Continues each prompt by up to `max_new_tokens` tokens; stops a row at `eos_id`.

  `prompts` [b, p] int32 are right-padded, row b's prompt being its first prompt_lengths[b]
  (>= 1) tokens. Stops early once every row has stopped. Traceable: jit it with the model's
  parameters as an argument and the keyword arguments static.
  """
  batch, prompt_len = prompts.shape
  cache = decode.init_cache(model, batch, prompt_len + max_new_tokens)
  positions = jnp.broadcast_to(jnp.arange(prompt_len), prompts.shape)
  logits, cache = decode.forward(model, cache, prompts, positions, logits_at=prompt_lengths - 1)
  first = next_token(logits, jax.random.fold_in(key, 0), sampling, num_tokens)
  tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = _stops(first, eos_id)

  def more(carry):
    t, _, _, done = carry
    return (t < max_new_tokens) & ~jnp.all(done)

  def step(carry):
    t, cache, tokens, done = carry
    fed = jax.lax.dynamic_slice_in_dim(tokens, t - 1, 1, axis=1)
    logits, cache = decode.forward(
      model, cache, fed, prompt_lengths[:, None] + t - 1, logits_at=jnp.zeros((batch,), jnp.int32)
    )
    new = next_token(logits, jax.random.fold_in(key, t), sampling, num_tokens)
    new = jnp.where(done, pad_id, new)
    tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, t))
    return t + 1, cache, tokens, done | _stops(new, eos_id)

  carry = (jnp.int32(1), cache, tokens, done)
  _, _, tokens, _ = jax.lax.while_loop(more, step, carry)
  return Generated(tokens=tokens, lengths=_lengths(tokens, eos_id, max_new_tokens))


def _stops(tokens, eos_id):
  return jnp.zeros(tokens.shape, bool) if eos_id is None else tokens == eos_id


def _lengths(tokens, eos_id, max_new_tokens):
  """Tokens up to and including the first EOS, else all of them."""
  if eos_id is None:
    return jnp.full(tokens.shape[:1], max_new_tokens, jnp.int32)
  is_eos = tokens == eos_id
  first_eos = jnp.argmax(is_eos, axis=-1)
  return jnp.where(jnp.any(is_eos, axis=-1), first_eos + 1, max_new_tokens).astype(jnp.int32)
