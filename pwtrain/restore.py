"""A run's latest checkpoint read back onto one mesh, whatever layout trained it, without
building or compiling its step; and whether a run has anything left to train.

Checkpoints hold the whole-model train state with its layers unrolled (docs/architecture.md),
so one abstract target serves every layout: the state `config` initialises (model parameters,
optimizer state, the exchange's state: with per-pod state, one copy per pod), sharded on `mesh`
by the parameters' logical axes. `pwtrain.sample` decodes from it; `train.run` returns it for a
run that has nothing left to train (`finished`).
"""

import logging
import os

import jax
import numpy as np
from jax.sharding import Mesh

from pwtrain import objectives, optim, processes
from pwtrain import step as step_lib
from pwtrain.checkpoint import Checkpointer, IncompatibleCheckpoint
from pwtrain.errors import ConfigError
from pwtrain.parallel import exchange as exchange_lib
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel import spmd, stages
from pwtrain.parallel.pipeline.state import train_state
from pwtrain.sharding import MESH_AXES

log = logging.getLogger(__name__)


def reading_mesh(config, devices=None):
  """A mesh over the first parallel.fsdp * parallel.expert * parallel.tensor local devices (data
  = 1: a few prompts, or one state read back, gain nothing from data parallelism), on which the
  parameters are sharded as in training."""
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


def target(config, mesh):
  """(the unrolled whole-model state's abstract arrays on `mesh`, as checkpoints hold it; the
  shardings of the state as the model holds it, stacked when model.scan_layers)."""
  fns = step_lib.model_fns(config.model, config.moe)
  tx, _ = optim.build(config.optim, config.train.num_steps)
  exchange = exchange_lib.make(config)  # what the run's state carries besides the optimizer
  reference = objectives.holds_reference(config)  # the frozen reference policy (GRPO's KL)
  whole = jax.eval_shape(lambda: train_state(fns, tx, config.seed, exchange, reference=reference))
  shardings = spmd.state_shardings(fns, mesh, whole)
  abstract = stages.unstack_state(spmd.with_shardings(whole, shardings))
  if exchange.per_pod_state:
    abstract = {"pods": [abstract] * config.parallel.pods}
  return abstract, shardings


def latest(config, workdir: str, mesh):
  """(step, whole-model state) of the latest readable checkpoint in <workdir>/checkpoints, read
  onto `mesh` (`target`; with per-pod state, {"pods": [each pod's state]}); a ConfigError
  naming the fix when there is none, or when it was written for another model."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise ConfigError(f"{directory} does not exist: is --workdir={workdir!r} a training run's?")
  abstract, _ = target(config, mesh)
  ckpt = Checkpointer(
    directory, keep=config.train.keep_checkpoints, every=1, async_save=False, read_only=True
  )
  try:
    found = ckpt.restore_latest(abstract)
  except IncompatibleCheckpoint as e:
    raise ConfigError(
      f"a checkpoint in {directory} does not match this config's model/optimizer ({e}); "
      "pass the config the run was trained with"
    ) from e
  finally:
    ckpt.close()
  if found is None:
    raise ConfigError(f"{directory} holds no readable checkpoint")
  step, state, _ = found
  return step, state


def finished(config, workdir: str):
  """Before anything is built: (step, state) for a workdir whose latest checkpoint is at or past
  train.num_steps, which has nothing to train (said in one line; its state read back with
  `latest` where this process is the run's only one, else None); None when there is training
  to do. A workdir with checkpoints and train.resume=False is refused."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory) or processes.rejoining():
    return None
  reader = Checkpointer(directory, keep=1, every=1, async_save=False, read_only=True)
  try:
    step = reader.latest_step()
  finally:
    reader.close()
  if step is None:
    return None
  if not config.train.resume:
    raise ConfigError(
      f"train.resume=False but {directory} already holds checkpoints (latest step {step}); "
      "use a fresh --workdir, or train.resume=True to continue from it"
    )
  if step < config.train.num_steps:
    return None
  state = None
  if jax.process_count() == 1:
    step, state = latest(config, workdir, reading_mesh(config))
  if step < config.train.num_steps:  # the latest was damaged: set aside, and its steps rerun
    return None
  log.warning(
    "nothing to train: %s holds step %d, and train.num_steps=%d; raise train.num_steps to go on",
    directory, step, config.train.num_steps,
  )  # fmt: skip
  return step, state


def state_from_params(config, step_program, params) -> dict:
  """`step_program`'s state at step 0 for `config` with `params` (a whole-model params tree,
  layers unrolled, host or device arrays: another run's, e.g. `latest(...)[1]["params"]`, or an
  imported model's) in place of the seeded initialisation: a fresh optimizer state, the
  exchange's entries, and with the objective's reference policy (GRPO with rl.kl_coef > 0) a
  frozen copy of `params` as "reference". Made on one device, then laid out as the program's
  state (its `abstract_state`'s shardings; every pod's copy with per-pod state)."""
  fns = step_lib.model_fns(config.model, config.moe)
  tx, _ = optim.build(config.optim, config.train.num_steps)
  exchange = exchange_lib.make(config)
  reference = objectives.holds_reference(config)
  make = lambda p: train_state(fns, tx, config.seed, exchange, params=p, reference=reference)
  whole = jax.jit(make)(jax.device_get(params))
  abstract = step_program.abstract_state
  if "pods" in abstract:
    whole = {"pods": [whole] * len(abstract["pods"])}
  whole = jax.device_put(whole, jax.tree.map(lambda a: a.sharding, abstract), may_alias=False)
  return step_program.from_checkpoint(whole)
