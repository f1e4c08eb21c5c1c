"""A trained run's model for inference, as `pwtrain.sample` and `pwtrain.serve` load it: the run's
config (`--config`, else <workdir>/config.json), its tokenizer, and its latest readable
checkpoint's parameters restored onto one island of this machine, whatever layout trained it.

Checkpoints hold the whole-model state, read here into a single-island mesh of parallel.fsdp *
parallel.expert * parallel.tensor local devices (parameters sharded by their logical axes, as
in training; parallel.data is 1, since a few prompts gain nothing from data parallelism). The
optimizer state and the exchange's state are restored with the parameters (the checkpoint holds
them; restore checks every array) and then dropped; runs whose pods differ (DiLoCo, error
feedback) are read at pod 0's parameters. The config's model.scan_layers picks the layout the
parameters are returned in (checkpoints hold layers unrolled; a scanned model stacks them),
whichever layout trained the run.
"""

import os

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from pwtrain import optim
from pwtrain import step as step_lib
from pwtrain import workdir as workdir_lib
from pwtrain.checkpoint import Checkpointer, IncompatibleCheckpoint
from pwtrain.data import build_tokenizer
from pwtrain.data.tokenizer import sentencepiece_path
from pwtrain.errors import ConfigError
from pwtrain.models import scan
from pwtrain.parallel import exchange as exchange_lib
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel import spmd, stages
from pwtrain.parallel.pipeline.state import train_state
from pwtrain.sharding import MESH_AXES


def load_config(config, workdir: str):
  """`config` (from --config) if given, else <workdir>/config.json as an ml_collections
  ConfigDict; a ValueError naming the fix if there is neither."""
  if config is not None:
    return config
  path, saved = workdir_lib.saved_config(workdir)
  if saved is None:
    raise ConfigError(
      f"{path} does not exist: pass the run's config with --config=<file> (and the "
      "--config.<key>=<value> overrides it was trained with)"
    )
  return ml_collections.ConfigDict(saved)


def sampling_mesh(config, devices=None):
  """A mesh over the first fsdp * expert * tensor local devices (data = 1)."""
  devices = list(jax.devices() if devices is None else devices)
  parallel = {axis: 1 if axis == "data" else int(config.parallel[axis]) for axis in MESH_AXES}
  fill = -1 in parallel.values()  # -1: fill the devices, as training does
  shape = plan_lib.resolve_mesh_shape(
    parallel, len(devices) if fill else int(np.prod(list(parallel.values())))
  )
  needed = int(np.prod(list(shape.values())))
  if not 1 <= needed <= len(devices):
    raise ConfigError(
      f"parallel.fsdp * parallel.expert * parallel.tensor = {needed} devices are needed to "
      f"hold the model as it was sharded; this machine has {len(devices)} (with --config, "
      "override them, e.g. --config.parallel.tensor=1)"
    )
  return Mesh(np.asarray(devices[:needed], dtype=object).reshape(tuple(shape.values())), MESH_AXES)


def restore_params(config, workdir: str, mesh):
  """(step, the model's ModelFns, params) of the latest readable checkpoint in
  <workdir>/checkpoints, the params sharded on `mesh` by their logical axes."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise ConfigError(f"{directory} does not exist: is --workdir={workdir!r} a training run's?")
  fns = step_lib.model_fns(config.model, config.moe)
  tx, _ = optim.build(config.optim, config.train.num_steps)
  exchange = exchange_lib.make(config)  # what the run's state carries besides the optimizer
  whole = jax.eval_shape(lambda: train_state(fns, tx, config.seed, exchange))
  shardings = spmd.state_shardings(fns, mesh, whole)
  # Checkpoints hold the layers unrolled; a scanned model's are stacked after the restore.
  abstract = stages.unstack_state(spmd.with_shardings(whole, shardings))
  if exchange.per_pod_state:
    abstract = {"pods": [abstract] * config.parallel.pods}
  ckpt = Checkpointer(
    directory, keep=config.train.keep_checkpoints, every=1, async_save=False, read_only=True
  )
  try:
    found = ckpt.restore_latest(abstract)
  except IncompatibleCheckpoint as e:
    raise ConfigError(
      f"the checkpoints in {directory} do not match this config's model/optimizer ({e}); "
      "pass the config the run was trained with"
    ) from e
  finally:
    ckpt.close()
  if found is None:
    raise ConfigError(f"{directory} holds no readable checkpoint")
  step, state, _ = found
  if exchange.per_pod_state:
    state = state["pods"][0]
  params = state["params"]
  if config.model.scan_layers:
    period = scan.period(config.moe)
    params = jax.device_put(stages.stack_state(params, period), shardings["params"])
  return step, fns, params


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
