"""rl.init_from: an RL run that has no checkpoint of its own starts from the parameters of
another run's latest checkpoint (a pretraining run, or a Hugging Face model imported with
`python -m pwtrain.convert`, whose workdir holds one and its config.json).

The checkpoint is read as `pwtrain.sample` reads it, with the config that run saved (its
<workdir>/config.json, so its optimizer state may differ from this run's; without one, this
run's config), onto one mesh whatever layout wrote it (restore.latest), and its model must be
this run's. Its params become this run's step-0 state (restore.state_from_params): a fresh
optimizer state, and with rl.kl_coef > 0 the reference policy is these params. From its first
checkpoint on, the run resumes from its own checkpoints like any other.
"""

import logging

from pwtrain import inference, restore, workdir
from pwtrain.errors import ConfigError

log = logging.getLogger(__name__)


def initial_state(config, step_program) -> dict:
  """`step_program`'s initial state: with rl.init_from in an RL run, the params of that run's
  latest checkpoint (module doc); else `step_program.init()`."""
  source = config.rl.init_from
  if config.train.objective != "grpo" or not source:
    return step_program.init()
  _, saved = workdir.saved_config(source)
  theirs = inference.load_config(None, source) if saved is not None else config
  if saved is not None and dict(saved["model"]) != config.model.to_dict():
    changed = sorted(k for k in saved["model"] if saved["model"][k] != config.model.get(k))
    raise ConfigError(
      f"rl.init_from={source!r} was trained with another model (model.{', model.'.join(changed)} "
      "differ); set this config's model.* to that run's"
    )
  step, state = restore.latest(theirs, source, restore.reading_mesh(theirs))
  if "pods" in state:
    state = state["pods"][0]
  log.info("rl.init_from: starting from the params of step %d of %s", step, source)
  return restore.state_from_params(config, step_program, state["params"])
