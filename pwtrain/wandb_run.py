"""A Weights & Biases run for a start of the training run (metrics.wandb_project): the optional
wandb dependency is imported here alone."""

import os

from pwtrain.errors import ConfigError


def start(project: str, entity: str, workdir: str, config: dict, start_step: int):
  """A W&B run for this start of the training run, or None when `project` is empty.

  wandb is an optional dependency (`pip install 'pwtrain[wandb]'`), imported only here. Each
  start (fresh, resumed) is its own W&B run, named "<workdir name>@<start step>" and grouped
  by the workdir's name, so a resume never writes over an earlier start's steps; every row
  carries its "step", the x-axis of every chart (rows from before a rollback keep theirs).
  Offline use, the API key and the server follow wandb's own environment (WANDB_MODE, ...).
  """
  if not project:
    return None
  try:
    import wandb
  except ImportError:
    raise ConfigError(
      f"metrics.wandb_project={project!r} needs wandb, which is not installed: "
      "pip install 'pwtrain[wandb]' (or set metrics.wandb_project='')"
    ) from None
  name = os.path.basename(os.path.normpath(workdir))
  run = wandb.init(
    project=project,
    entity=entity or None,
    dir=workdir,
    group=name,
    name=f"{name}@{start_step}",
    config=config,
  )
  run.define_metric("step")
  run.define_metric("*", step_metric="step")
  return run
