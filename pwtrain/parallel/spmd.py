"""The single-island step program: init and train step compiled for one SPMD mesh.

Parameters and optimizer state are created already sharded (the init function is compiled with
the state's out_shardings), and the step donates its input state. With scanned layers the state
is stacked (models/scan.py) while checkpoints hold it unrolled: `to_checkpoint` unstacks it on
the island, `from_checkpoint` stacks it back into the state's shardings.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain import guard
from pwtrain import sharding as sharding_lib
from pwtrain import step as step_lib
from pwtrain.backend import Controller, Node, Program, Transfer
from pwtrain.models import moe as moe_lib
from pwtrain.models import scan as scan_lib
from pwtrain.parallel.stages import is_param_dict, stack_state, unstack_state


@dataclasses.dataclass
class SpmdProgram:
  """The StepProgram (parallel/program.py) of one island: one state, one train_step node."""

  program: Program
  abstract_state: dict  # whole-model state, unrolled, with shardings (the restore target)
  init: object  # () -> {state key: state}, run on the controller
  executables: dict
  build_eval: Callable[[], Program]  # compiles the forward-only program (see eval_program)
  shardings: dict  # the train state's shardings
  period: int = 0  # scanned layers: layers per stacked period (models/scan.py); 0: unrolled
  state_keys: tuple = ("state",)
  exchange_bytes: int = 0  # bytes sent across pods per step (one island: none)
  columns: tuple = ("inputs", "targets")  # the batch's columns (the objective's)

  def program_for(self, step: int) -> Program:
    del step
    return self.program

  @functools.cached_property
  def eval_program(self) -> Program:
    return self.build_eval()

  def feed(self, batch: dict) -> dict:
    return {"batch": {k: batch[k] for k in self.columns}}

  def feed_rows(self, num_rows: int) -> dict[str, range]:
    return {"batch": range(num_rows)}

  def to_checkpoint(self, state: dict) -> dict:
    return unstack_state(state["state"])

  def from_checkpoint(self, whole: dict) -> dict:
    if not self.period:
      return {"state": whole}
    return {"state": jax.device_put(stack_state(whole, self.period), self.shardings)}


def state_shardings(fns, mesh, abstract_state, rules=sharding_lib.DEFAULT_RULES):
  """Shardings for a train state: params by their logical axes; every param-shaped dict in it
  (optimizer moments, stale gradients, DiLoCo's anchor and momentum) like the params; the rest
  (counters, scalars, the RNG key) replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  params = jax.tree.map(  # the state's params' shapes: a dim split only where it divides
    lambda axes, param: sharding_lib.named_sharding(mesh, axes, rules, param.shape),
    fns.logical_axes,
    abstract_state["params"],
    is_leaf=lambda x: isinstance(x, tuple),
  )

  def shard(x):
    if not is_param_dict(x):
      return replicated
    # Per-param placeholders of other shapes (e.g. Adafactor's unused factored rows/columns)
    # are replicated.
    return jax.tree.map(
      lambda leaf, s, p: s if leaf.shape == p.shape else replicated,
      x,
      params,
      abstract_state["params"],
    )

  return jax.tree.map(shard, abstract_state, is_leaf=is_param_dict)


def with_shardings(abstract, shardings):
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )


def build(config, plan, controller: Controller, tx, schedule, objective) -> SpmdProgram:
  island = plan.cells[(0, 0)]
  mesh = plan.mesh((0, 0))
  fns = step_lib.model_fns(config.model, config.moe)
  init_fn = lambda: step_lib.init_state(fns, tx, config.seed, reference=objective.holds_reference)
  abstract = jax.eval_shape(init_fn)
  shardings = state_shardings(fns, mesh, abstract)
  abstract_state = with_shardings(abstract, shardings)

  batch_sharding = sharding_lib.named_sharding(mesh, ("batch", "length"))
  batch_shape = (config.train.global_batch, config.data.seq_len)
  abstract_batch = {
    k: jax.ShapeDtypeStruct(batch_shape, dtype, sharding=batch_sharding)
    for k, dtype in objective.columns.items()
  }
  eval_batch = {k: abstract_batch[k] for k in ("inputs", "targets")}
  grad_fn = step_lib.accumulate(
    step_lib.loss_and_grads(fns, objective=objective), config.train.num_microbatches
  )
  update_fn = guard.wrap_update(
    step_lib.apply_update(tx, schedule, config.optim.clip_norm, objective), config.train
  )
  if moe_lib.enabled(config.moe):
    update_fn = moe_lib.with_metrics(config.moe, update_fn)
  train_step = step_lib.train_step(grad_fn, update_fn)
  replicated = NamedSharding(mesh, PartitionSpec())

  init_exe = controller.compile(
    "init", init_fn, island.name, (), mesh=mesh, out_shardings=shardings
  )
  step_exe = controller.compile(
    "train_step",
    train_step,
    island.name,
    (abstract_state, abstract_batch),
    mesh=mesh,
    out_shardings=(shardings, replicated),
    donate_argnums=(0,),
  )
  program = Program(
    nodes=(
      Transfer("batch_in", "batch", island.name, batch_sharding),
      Node("train_step", step_exe, ("state", ("batch_in", 0))),
    ),
    outputs={"state": ("train_step", 0), "metrics": ("train_step", 1)},
    carried=("state",),
  )
  init_program = Program(
    nodes=(Node("init", init_exe, ()),), outputs={"state": ("init", 0)}, carried=("state",)
  )

  def init():
    return {"state": controller.run(init_program, {})["state"].result()}

  executables = {"init": init_exe, "train_step": step_exe}

  def build_eval() -> Program:
    sums = step_lib.accumulate(
      step_lib.eval_sums(fns, z_loss=config.model.z_loss), config.train.num_microbatches
    )
    eval_exe = controller.compile(
      "eval_step",
      lambda state, batch: sums(state["params"], batch),
      island.name,
      (abstract_state, eval_batch),
      mesh=mesh,
      out_shardings=replicated,
    )
    executables["eval_step"] = eval_exe
    return Program(
      nodes=(
        Transfer("batch_in", "batch", island.name, batch_sharding),
        Node("eval_step", eval_exe, ("state", ("batch_in", 0))),
      ),
      outputs={"eval/0": ("eval_step", 0)},
    )

  period = scan_lib.period(config.model, config.moe) if config.model.scan_layers else 0
  return SpmdProgram(
    program,
    unstack_state(abstract_state),
    init,
    executables,
    build_eval,
    shardings,
    period,
    columns=tuple(objective.columns),
  )
