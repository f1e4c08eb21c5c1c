"""Builds the MPMD step: every cell's pieces compiled (init, zeros, the stage's computation
from compute.py, the exchange's, emb, finish, apply, norms), then wired into one Program by
wiring.py, and the PipelineProgram (state.py) around it.
"""

import jax
import jax.numpy as jnp

from pwtrain import guard
from pwtrain import step as step_lib
from pwtrain.backend import Controller, Node, Program
from pwtrain.models import family
from pwtrain.models import moe as moe_lib
from pwtrain.models import scan as scan_lib
from pwtrain.parallel import spmd
from pwtrain.parallel.pipeline import compute
from pwtrain.parallel.pipeline import pieces as pieces_lib
from pwtrain.parallel.pipeline.schedule import splits_backward
from pwtrain.parallel.pipeline.state import PipelineProgram, state_key, train_state, whole_abstract
from pwtrain.parallel.pipeline.wiring import ProgramBuilder
from pwtrain.parallel.stages import to_stage


def build(config, plan, controller: Controller, tx, schedule, objective) -> PipelineProgram:
  assert not plan.single_island, "one stage on one island is spmd.build's job"
  exchange, stages = plan.exchange, list(plan.stages)
  whole_fns = step_lib.model_fns(config.model, config.moe)
  reference = objective.holds_reference
  whole_init = lambda: train_state(whole_fns, tx, config.seed, exchange, reference=reference)
  whole = jax.eval_shape(whole_init)
  update = guard.wrap_update(
    step_lib.apply_update(tx, schedule, config.optim.clip_norm, objective), config.train
  )
  # MoE: each stage adds its weighted aux losses to what it differentiates, and passes the
  # running MoE stats forward with its activations, so the last stage's stats cover all stages.
  moe = config.moe if moe_lib.enabled(config.moe) else None
  if moe:
    update = moe_lib.with_metrics(moe, update)
  update = exchange.wrap_update(update)

  pieces, cells = {}, {}
  for (p, s), island in plan.cells.items():
    stage = stages[s]
    mesh = plan.mesh((p, s))
    fns = step_lib.model_fns(config.model, config.moe, **stage.model_kwargs())
    abstract = to_stage(whole, stage)
    shardings = spmd.state_shardings(fns, mesh, abstract)
    cell = pieces_lib.cell_pieces(
      config,
      objective,
      key=(p, s),
      stage=stage,
      num_stages=plan.num_stages,
      island=island,
      mesh=mesh,
      fns=fns,
      state_abs=spmd.with_shardings(abstract, shardings),
      shardings=shardings,
      controller=controller,
      pieces=pieces,
    )
    cells[(p, s)] = cell
    _compile_cell(cell, whole_init, update, exchange, moe, config, plan.num_pods)

  def build_programs(hosts: dict) -> dict:
    builder = lambda kind: ProgramBuilder(plan, pieces, config, hosts).program(kind)
    return {kind: builder(kind) for kind in exchange.program_kinds}

  init_program = Program(
    nodes=tuple(Node(f"{p}:init{s}", pieces[("init", p, s)].executable, ()) for p, s in cells),
    outputs={state_key(c): (f"{c[0]}:init{c[1]}", 0) for c in cells},
    carried=tuple(state_key(c) for c in cells),
  )

  def init():
    out = controller.run(init_program, {})
    return {k: v.result() for k, v in out.items()}

  cell_abstract = {c: cell.state_abs for c, cell in cells.items()}
  stage_grads = [cells[(0, s)].grads_abs for s in range(plan.num_stages)]
  executables = {key: piece.executable for key, piece in pieces.items()}

  def build_eval(hosts: dict) -> Program:
    # Each cell's eval piece compiled once, at the first program that runs it: a hosted pod's
    # cells run on their hosts' (elastic pods: a lost remote worker cannot compile).
    for (p, s), cell in cells.items():
      if p not in hosts and not {("EF", p, s), ("EL", p, s)} & pieces.keys():
        compute.compile_eval(cell, config.model.z_loss)
    executables.update({key: piece.executable for key, piece in pieces.items()})
    return ProgramBuilder(plan, pieces, config, hosts).eval_program()

  return PipelineProgram(
    programs=build_programs({}),
    build_programs=build_programs,
    build_eval=build_eval,
    abstract_state=whole_abstract(cell_abstract, stages, plan.num_pods, exchange.per_pod_state),
    init=init,
    executables=executables,
    stages=stages,
    num_pods=plan.num_pods,
    num_micro=config.train.num_microbatches,
    cell_shardings={c: cell.shardings for c, cell in cells.items()},
    exchange=exchange,
    exchange_bytes=exchange.bytes_per_step(stage_grads),
    period=scan_lib.period(config.model, config.moe) if config.model.scan_layers else 0,
    columns=tuple(objective.columns),
  )


def _compile_cell(cell, whole_init, update, exchange, moe, config, num_pods: int) -> None:
  """Every piece of one cell: init, zeros, the stage's F/B/FB, the exchange's, emb, finish,
  apply, and on the last stage of the pods that may report the metrics norms (pod 0's; with
  elastic pods every pod's, any of which reports when pod 0 is hosted)."""
  stage, num_stages = cell.stage, cell.num_stages
  cell.compile("init", lambda: to_stage(whole_init(), stage), {}, out_shardings=cell.shardings)

  def zeros_fn(state):  # the step's running gradient sums and loss statistics
    zero_grads = jax.tree.map(jnp.zeros_like, state["params"])
    return zero_grads, pieces_lib.zero_stats(cell.objective, config.moe.num_experts)

  cell.compile(
    "zeros",
    zeros_fn,
    {"state": cell.state_abs},
    out_shardings=(cell.grads_sharding, cell.sharding_of(cell.stats_abs)),
  )
  split = splits_backward(config.parallel.schedule, stage)
  compute.compile_stage(cell, moe, config.parallel.stage_remat, split)
  exchange.compile_cell(cell)

  # A tied output layer's embedding, used on the first and the last stage.
  tied = num_stages > 1 and (stage.first or stage.last) and family.of(config.model).tied
  if tied:
    cell.compile(
      "emb",
      lambda grads: grads["embedding"],
      {"grads": cell.grads_abs},
      out_shardings=cell.grads_sharding["embedding"],
    )

  def finish_fn(grads, other=None):
    # The embedding's gradient is the sum of its use as input (first stage) and as output
    # layer (last stage); both ends add the halves in the same order, so their copies of the
    # embedding stay bitwise equal. It is counted in the norm once, on the first stage.
    if other is not None:
      own = grads["embedding"]
      grads = {**grads, "embedding": own + other if stage.first else other + own}
    return grads, step_lib.sum_of_squares(stage.counted(grads))

  cell.compile(
    "finish",
    finish_fn,
    {"grads": cell.grads_abs, **({"other": cell.grads_abs["embedding"]} if tied else {})},
    out_shardings=(cell.grads_sharding, cell.replicated),
    donate=("grads",),
  )

  pod = cell.key[0]

  def apply_fn(state, grads, stats, sumsq, **extras):
    new_state, metrics = exchange.update(update, pod, state, grads, stats, sum(sumsq), **extras)
    # The stage's share of the parameter and update norms, counted as the gradient norm is.
    shares = [stage.counted(st["params"]) for st in (state, new_state)]
    return new_state, metrics, step_lib.norm_sums(*shares)

  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=cell.replicated)
  cell.compile(
    "apply",
    apply_fn,
    {
      "state": cell.state_abs,
      "grads": cell.grads_abs,
      "stats": [cell.stats_abs] * num_pods,
      "sumsq": [scalar] * num_stages,
      **exchange.apply_inputs(cell),
    },
    out_shardings=(cell.shardings, cell.replicated, cell.replicated),
    donate=("state",),
  )
  if cell.key[1] == num_stages - 1 and (pod == 0 or config.fault.elastic):  # may report
    sums = cell.pieces[("apply", *cell.key)].out_abstract[2]
    cell.compile(
      "norms",
      lambda metrics, sums: step_lib.with_norms(metrics, sums),
      {"metrics": cell.pieces[("apply", *cell.key)].out_abstract[1], "sums": [sums] * num_stages},
      out_shardings=cell.replicated,
    )
