"""The RL loop's settings (rl.* after the objective's, which objectives.py checks) checked in one
line each, and what they open: the run's tokenizer, prompt source and reward function.

Layouts. Rollouts run on the serving engine over the live weights (serve/weights.py), which
serves one island with any mesh, pods (the last live pod's cells) and pipelines. An RL run
refuses, in one line: elastic pods (fault.elastic: a step's batch is made for the pods that
were live when it was sampled) and distributed mode (the engine runs on process 0's islands
only), rl.max_staleness other than 0 or 1, and rl.max_staleness=1 in remote mode (its
copy of the weights is made on this host's islands).
"""

import os

from pwtrain import inference
from pwtrain.errors import ConfigError
from pwtrain.rl import prompts as prompts_lib
from pwtrain.rl import rewards as rewards_lib
from pwtrain.rl import tasks


def validate(config) -> None:
  """Errors for the loop's rl.* settings and the layouts an RL run cannot use (module doc);
  nothing for train.objective="lm"."""
  if config.train.objective != "grpo":
    return
  rl, train = config.rl, config.train
  if rl.task and rl.prompts:
    raise ConfigError(
      f"rl.task={rl.task!r} and rl.prompts={rl.prompts!r} are both set; set one (the task "
      "generates its prompts)"
    )
  if rl.task:
    tasks.tokenizer(rl.task)  # one of TASKS
  elif not rl.prompts:
    raise ConfigError("train.objective='grpo' needs prompts: set rl.prompts (a JSONL file) or "
                      f"rl.task (one of {', '.join(tasks.TASKS)})")  # fmt: skip
  elif not rl.reward:
    raise ConfigError(
      f"rl.prompts={rl.prompts!r} needs rl.reward: 'module:function' or a built-in "
      f"({', '.join(rewards_lib.BUILT_IN)})"
    )
  if not isinstance(rl.group_size, int) or rl.group_size < 2:
    raise ConfigError(
      f"rl.group_size={rl.group_size!r} must be an integer >= 2 (advantages compare a prompt's "
      "completions)"
    )
  if train.global_batch % rl.group_size:
    raise ConfigError(
      f"train.global_batch={train.global_batch} is not a multiple of rl.group_size="
      f"{rl.group_size}: each row is one completion, each prompt group_size rows"
    )
  if not isinstance(rl.max_tokens, int) or not 1 <= rl.max_tokens < config.data.seq_len:
    raise ConfigError(
      f"rl.max_tokens={rl.max_tokens!r} must be an integer in [1, data.seq_len="
      f"{config.data.seq_len}) (prompt and completion share a row)"
    )
  if rl.max_staleness not in (0, 1) or isinstance(rl.max_staleness, bool):
    raise ConfigError(
      f"rl.max_staleness={rl.max_staleness!r} must be 0 (rollouts from the weights after the "
      "previous step) or 1 (from those one step older, made while the previous step trains)"
    )
  if rl.max_staleness == 1 and config.backend.mode == "remote":
    raise ConfigError(
      "rl.max_staleness=1 copies the weights on the islands, which backend.mode='remote' does "
      "not do; set rl.max_staleness=0 or backend.mode='embedded'"
    )
  if config.fault.elastic:
    raise ConfigError(
      "fault.elastic=True cannot run train.objective='grpo' (a step's rollouts are sampled on "
      "the pods live before it); set fault.elastic=False"
    )
  if config.backend.mode == "distributed":
    raise ConfigError(
      "backend.mode='distributed' cannot run train.objective='grpo' (the rollouts' engine runs "
      "on one process); use backend.mode='embedded' or 'remote'"
    )
  if rl.init_from and not os.path.isdir(os.path.join(rl.init_from, "checkpoints")):
    raise ConfigError(
      f"rl.init_from={rl.init_from!r} has no checkpoints directory; name a run's --workdir (an "
      "imported model's included)"
    )


def tokenizer(config, workdir: str):
  """The run's tokenizer: the task's vocabulary (rl.task), else data.tokenizer's (a
  SentencePiece model must exist: an RL run reads no corpus to train one)."""
  if config.rl.task:
    return tasks.tokenizer(config.rl.task)
  return inference.run_tokenizer(config, workdir)


def open_source(config, workdir: str):
  """(tokenizer, prompt source, reward) of an RL run; every error one line."""
  rl = config.rl
  if rl.task:
    source = tasks.ShiftPrompts(config.seed)
  else:
    source = prompts_lib.PromptFile(os.path.expanduser(rl.prompts), rl.prompt_field)
  reward = rewards_lib.Reward(rl.reward or rl.task)
  return tokenizer(config, workdir), source, reward
