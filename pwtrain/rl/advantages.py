"""Group-normalised advantages (GRPO) and the batch the GRPO step trains on.

Advantages. Each prompt's `group_size` completions form a group; a completion's advantage is
its reward minus the group's mean, divided by the group's standard deviation (population std,
plus `EPS`) when rl.normalize_std (Dr. GRPO leaves the division out). A group whose rewards are
all equal says nothing about which completion is better: its advantages are exactly 0, its
rows carry no gradient (every target masked, so they do not count in the token mean either),
and it is counted (`zero_variance`).

The batch: a dict of arrays, each [rows, seq_len], one row per completion, left-aligned: the
prompt's ids (EOS first), then the completion's ids as sampled (its EOS included, when it
stopped at one), then padding.

  inputs             int32: the row's ids without its last, then pad_id
  targets            int32: at position t the id at t + 1 where that id is a completion token,
                     else -1 (no loss: prompt, padding, masked groups)
  advantages         float32: the row's advantage at its completion positions, else 0
  behavior_logprobs  float32: the sampler's log-prob of the target id under the distribution it
                     was drawn from (pieces.py's sampled_logprob) at completion positions, else 0
"""

import dataclasses

import numpy as np

from pwtrain.errors import ConfigError

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Advantages:
  values: np.ndarray  # float32 [prompts, group_size]
  zero_variance: np.ndarray  # bool [prompts]: the group's rewards are all equal


def group_advantages(rewards: np.ndarray, normalize_std: bool = True) -> Advantages:
  """rewards [prompts, group_size] -> their advantages (module doc)."""
  rewards = np.asarray(rewards, np.float64)
  mean = rewards.mean(axis=1, keepdims=True)
  std = rewards.std(axis=1, keepdims=True)
  zero = np.all(rewards == rewards[:, :1], axis=1)
  centred = rewards - mean
  values = centred / (std + EPS) if normalize_std else centred
  values[zero] = 0.0
  return Advantages(values.astype(np.float32), zero)


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One completion: its prompt's ids (EOS first) and its sampled ids with their behaviour
  log-probs."""

  prompt: np.ndarray
  tokens: np.ndarray
  logprobs: np.ndarray


def assemble(
  rollouts: list[Rollout], advantages: np.ndarray, masked: np.ndarray, seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
  """The batch of `rollouts` (module doc); `advantages` [rows], `masked` [rows] bool: rows
  whose targets are all -1 (zero-variance groups)."""
  rows = len(rollouts)
  batch = {
    "inputs": np.full((rows, seq_len), pad_id, np.int32),
    "targets": np.full((rows, seq_len), -1, np.int32),
    "advantages": np.zeros((rows, seq_len), np.float32),
    "behavior_logprobs": np.zeros((rows, seq_len), np.float32),
  }
  for r, rollout in enumerate(rollouts):
    ids = np.concatenate([rollout.prompt, rollout.tokens]).astype(np.int32)
    if len(ids) - 1 > seq_len:
      raise ConfigError(
        f"a prompt of {len(rollout.prompt)} tokens and a completion of {len(rollout.tokens)} "
        f"need {len(ids) - 1} positions, more than data.seq_len={seq_len}; raise data.seq_len "
        "or lower rl.max_tokens"
      )
    batch["inputs"][r, : len(ids) - 1] = ids[:-1]
    if masked[r] or not len(rollout.tokens):
      continue
    start, end = len(rollout.prompt) - 1, len(ids) - 1  # positions predicting completion ids
    batch["targets"][r, start:end] = rollout.tokens
    batch["advantages"][r, start:end] = advantages[r]
    batch["behavior_logprobs"][r, start:end] = rollout.logprobs
  return batch
