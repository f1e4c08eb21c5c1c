"""Reinforcement learning from sampled completions (train.objective="grpo", docs/rl.md): the
loop that makes each GRPO step's batch from rollouts of the live weights. The objective itself
is pwtrain/objectives.py's; this package is everything before the batch.

  tasks.py       the toy task "shift": its prompts, answers, reward and vocabulary
  prompts.py     prompts from a JSONL file, checked when the run starts
  rewards.py     reward functions: built-ins and "module:function", each call checked
  advantages.py  group-normalised advantages and the batch's arrays
  rollouts.py    the batch source: the serving engine over the live weights, each step
  init_from.py   rl.init_from: the params of another run's latest checkpoint
  settings.py    the rl.* keys checked; the run's tokenizer, prompts and reward opened
"""

import contextlib

from pwtrain.rl.init_from import initial_state
from pwtrain.rl.rollouts import RolloutBatches
from pwtrain.rl.settings import open_source, validate

__all__ = [
  "RolloutBatches",
  "initial_state",
  "rollout_batches",
  "running",
  "validate",
]


def rollout_batches(config, workdir: str) -> RolloutBatches:
  """The RL run's batch source (not started: `running`)."""
  tokenizer, prompts, reward = open_source(config, workdir)
  return RolloutBatches(config, tokenizer, prompts, reward)


@contextlib.contextmanager
def running(batches, harness, state: dict, step: int):
  """`batches` (a RolloutBatches; anything else: nothing to do) sampling on `harness`'s islands
  from `state` at `step` while the block runs."""
  if not isinstance(batches, RolloutBatches):
    yield
    return
  current = lambda: harness  # noqa: E731
  batches.start(harness.controller, current, state, step, published=batches.config.serve.enabled)
  try:
    yield
  finally:
    batches.close()
