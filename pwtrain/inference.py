"""A trained run's model for inference, as `pwtrain.sample` and `pwtrain.serve` load it: the run's
config (`--config`, else <workdir>/config.json), its tokenizer, and its latest readable
checkpoint's parameters restored onto one island of this machine (pwtrain/restore.py), whatever
layout trained it.

The optimizer state and the exchange's state are restored with the parameters (the checkpoint
holds them; restore checks every array) and then dropped; runs whose pods differ (DiLoCo, error
feedback) are read at pod 0's parameters. The config's model.scan_layers picks the layout the
parameters are returned in (checkpoints hold layers unrolled; a scanned model stacks them),
whichever layout trained the run.
"""

import os

import jax
import ml_collections

from pwtrain import restore
from pwtrain import step as step_lib
from pwtrain import workdir as workdir_lib
from pwtrain.data import build_tokenizer
from pwtrain.data.tokenizer import sentencepiece_path
from pwtrain.errors import ConfigError
from pwtrain.models import scan
from pwtrain.parallel import stages

reading_mesh = restore.reading_mesh  # the one island the parameters are read onto


def load_config(config, workdir: str):
  """`config` (from --config) if given, else <workdir>/config.json as an ml_collections
  ConfigDict; a ConfigError naming the fix if there is neither."""
  if config is not None:
    return config
  path, saved = workdir_lib.saved_config(workdir)
  if saved is None:
    raise ConfigError(
      f"{path} does not exist: pass the run's config with --config=<file> (and the "
      "--config.<key>=<value> overrides it was trained with)"
    )
  return ml_collections.ConfigDict(saved)


def restore_params(config, workdir: str, mesh):
  """(step, the model's ModelFns, params) of the latest readable checkpoint in
  <workdir>/checkpoints (restore.latest), the params sharded on `mesh` by their logical axes;
  runs whose pods differ give pod 0's."""
  step, state = restore.latest(config, workdir, mesh)
  if "pods" in state:
    state = state["pods"][0]
  params = state["params"]
  if config.model.scan_layers:
    _, shardings = restore.target(config, mesh)
    period = scan.period(config.model, config.moe)
    params = jax.device_put(stages.stack_state(params, period), shardings["params"])
  return step, step_lib.model_fns(config.model, config.moe), params


def latest_step(workdir: str) -> int | None:
  """The newest committed checkpoint's step in <workdir>/checkpoints (None: none), read beside
  a possibly running job: the directories named by a step alone (a save in progress is written
  under a temporary name, and its step's name appears when it is committed). Cheap enough to
  poll; `restore_params` then checks what it reads."""
  try:
    names = os.listdir(os.path.join(workdir, "checkpoints"))
  except FileNotFoundError:
    return None
  return max((int(name) for name in names if name.isdigit()), default=None)


def run_tokenizer(config, workdir: str):
  """The run's tokenizer; never trains one (SentencePiece must be in <workdir>/tokenizer)."""
  if config.data.tokenizer == "sentencepiece":
    path = sentencepiece_path(workdir, config.data.sp_vocab_size)
    if not os.path.exists(path):
      raise ConfigError(f"{path} does not exist: the run's SentencePiece model is missing")
  return build_tokenizer(config.data, workdir)
