"""rl.init_from: an RL run that has no checkpoint of its own starts from the parameters of
another run's latest checkpoint (a pretraining run, or a Hugging Face model imported with
`python -m pwtrain.convert`, whose workdir holds one), read as `pwtrain.sample` reads it
(restore.latest: written by any layout, onto one mesh) and placed as this run's step program
lays its parameters out. Everything else (optimizer state, step 0, the reference policy of
rl.kl_coef > 0, which is the parameters the run starts from) is this run's own initial state;
from its first checkpoint on, the run resumes from its own checkpoints like any other.
"""

import logging

import jax

from pwtrain import restore

log = logging.getLogger(__name__)

REFERENCE = "reference"  # the train state's frozen reference parameters (objectives.py)


def initial_state(config, step_program) -> dict:
  """`step_program`'s initial state, with the params (and the reference) of rl.init_from's
  latest checkpoint in an RL run that sets it; a ConfigError naming the fix if there is none or
  it is another model's."""
  workdir = config.rl.init_from
  if config.train.objective != "grpo" or not workdir:
    return step_program.init()
  step, other = restore.latest(config, workdir, restore.reading_mesh(config))
  if "pods" in other:
    other = other["pods"][0]
  whole = step_program.to_checkpoint(step_program.init())
  pods = whole["pods"] if "pods" in whole else [whole]
  for state in pods:
    for key in ("params", REFERENCE):
      if key in state:
        state[key] = jax.tree.map(
          lambda new, old: jax.device_put(new, old.sharding), other["params"], state[key]
        )
  log.info("rl.init_from: starting from the params of step %d of %s", step, workdir)
  return step_program.from_checkpoint(whole)
