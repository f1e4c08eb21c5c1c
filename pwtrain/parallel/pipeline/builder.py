"""Builds the MPMD step: every cell's pieces compiled, then wired into one Program.

Cell (p, s) is stage s of pod p, on the island the plan gives it. Besides the stage's pieces
(pieces.py) the step moves activations forward, activation gradients backward, the shared
embedding's gradient halves between the first and last stage, the loss statistics and squared
norms to every cell, each of pod 0's stages' share of the parameter and update norms to its
last stage (which reports the metrics), and whatever the exchange sends between pods
(exchange/*.py). Node names are prefixed with the pod ("1:F0.3"); transfers are named for what
they carry ("1:act2.0", "0>1:g1" from pod 0 to pod 1). Each island's nodes follow the schedule
(schedule.py; interleaved: several chunks' cells per island), and each island's scheduler
launches them in that order as their inputs appear.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pwtrain import guard
from pwtrain import sharding as sharding_lib
from pwtrain import step as step_lib
from pwtrain.backend import Controller, Node, Program, Transfer
from pwtrain.models import moe as moe_lib
from pwtrain.models import scan as scan_lib
from pwtrain.parallel import spmd
from pwtrain.parallel.pipeline import compute
from pwtrain.parallel.pipeline import pieces as pieces_lib
from pwtrain.parallel.pipeline.schedule import (
  interleave,
  island_order,
  island_orders,
  splits_backward,
)
from pwtrain.parallel.pipeline.state import PipelineProgram, state_key, train_state, whole_abstract
from pwtrain.parallel.stages import to_stage


def build(config, plan, controller: Controller, tx, schedule) -> PipelineProgram:
  assert not plan.single_island, "one stage on one island is spmd.build's job"
  exchange, stages = plan.exchange, list(plan.stages)
  whole_fns = step_lib.model_fns(config.model, config.moe)
  whole_init = lambda: train_state(whole_fns, tx, config.seed, exchange)
  whole = jax.eval_shape(whole_init)
  update = guard.wrap_update(
    step_lib.apply_update(tx, schedule, config.optim.clip_norm), config.train
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

  builder = lambda kind: ProgramBuilder(plan, pieces, config).program(kind)
  programs = {kind: builder(kind) for kind in exchange.program_kinds}
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

  def build_eval() -> Program:
    for cell in cells.values():
      compute.compile_eval(cell, config.model.z_loss)
    executables.update({key: piece.executable for key, piece in pieces.items()})
    return ProgramBuilder(plan, pieces, config).eval_program()

  return PipelineProgram(
    programs=programs,
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
    period=scan_lib.period(config.moe) if config.model.scan_layers else 0,
  )


def _compile_cell(cell, whole_init, update, exchange, moe, config, num_pods: int) -> None:
  """Every piece of one cell: init, zeros, the stage's F/B/FB, the exchange's, emb, finish,
  apply, and on pod 0's last stage norms."""
  stage, num_stages = cell.stage, cell.num_stages
  cell.compile("init", lambda: to_stage(whole_init(), stage), {}, out_shardings=cell.shardings)

  def zeros_fn(state):  # the step's running gradient sums and loss statistics
    zero_grads = jax.tree.map(jnp.zeros_like, state["params"])
    return zero_grads, pieces_lib.zero_stats(config.moe.num_experts)

  cell.compile(
    "zeros",
    zeros_fn,
    {"state": cell.state_abs},
    out_shardings=(cell.grads_sharding, cell.sharding_of(cell.stats_abs)),
  )
  split = splits_backward(config.parallel.schedule, stage)
  compute.compile_stage(cell, moe, config.model.z_loss, config.parallel.stage_remat, split)
  exchange.compile_cell(cell)

  tied = num_stages > 1 and (stage.first or stage.last)
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
  if cell.key == (0, num_stages - 1):  # the cell that reports the step's metrics
    sums = cell.pieces[("apply", *cell.key)].out_abstract[2]
    cell.compile(
      "norms",
      lambda metrics, sums: step_lib.with_norms(metrics, sums),
      {"metrics": cell.pieces[("apply", *cell.key)].out_abstract[1], "sums": [sums] * num_stages},
      out_shardings=cell.replicated,
    )


class ProgramBuilder:
  """Emits the step's nodes cell by cell, then interleaves them into one dispatch order."""

  state_key = staticmethod(state_key)

  def __init__(self, plan, pieces: dict, config):
    self.plan, self.pieces, self.exchange = plan, pieces, plan.exchange
    self.cells = list(plan.cells)
    self.pods = sorted({p for p, _ in self.cells})
    self.num_stages = plan.num_stages
    self.num_micro = config.train.num_microbatches
    self.schedule = config.parallel.schedule
    self.has_moe = moe_lib.enabled(config.moe)
    self.virtual = plan.virtual_stages
    # One node list per cell, merged by `interleave`; interleaved, one per island (its chunks'
    # nodes in the schedule's order).
    self.queues: dict = {self.queue_of(c): [] for c in self.cells}
    self.kind = "step"  # the program kind being built (exchange.program_kinds)

  def queue_of(self, cell: tuple) -> tuple:
    return (cell[0], cell[1] % (self.num_stages // self.virtual)) if self.virtual > 1 else cell

  def piece(self, cell: tuple, kind: str) -> pieces_lib.Piece:
    return self.pieces[(kind, *cell)]

  def move(self, cell, name, src, names=None, sharding=None):
    """Transfer `src` onto `cell`'s island, sharded by logical `names` (or `sharding`)."""
    if sharding is None:
      sharding = sharding_lib.named_sharding(self.plan.mesh(cell), names)
    self.queues[self.queue_of(cell)].append(
      Transfer(name, src, self.plan.cells[cell].name, sharding)
    )
    return (name, 0)

  def node(self, cell, kind: str, suffix: str = "", **refs) -> str:
    """Adds `cell`'s piece `kind` with its named input refs; returns the node's name."""
    piece = self.piece(cell, kind)
    name = f"{cell[0]}:{kind}{cell[1]}{suffix}"
    self.queues[self.queue_of(cell)].append(Node(name, piece.executable, piece.args(refs)))
    return name

  def program(self, kind: str = "step") -> Program:
    self.kind, last = kind, self.num_stages - 1
    grads, stats = self._backward()
    grads = self.exchange.gradient_nodes(self, grads)

    # The shared embedding: each end sends its (pod-summed) half of the gradient to the other.
    tied = [c for c in self.cells if self.num_stages > 1 and c[1] in (0, last)]
    for cell in tied:
      self.node(cell, "emb", grads=grads[cell])
    for p, s in self.cells:
      refs = {"grads": grads[(p, s)]}
      if (p, s) in tied:
        other = last if s == 0 else 0
        src = (f"{p}:emb{other}", 0)
        refs["other"] = self.move((p, s), f"{p}:emb{other}to{s}", src, ("vocab", "embed"))
      self.node((p, s), "finish", **refs)

    # Every cell clips by the same global norm and normalises by the same token count.
    for p, s in self.cells:
      cell = (p, s)
      sumsq = [
        (f"{p}:finish{t}", 1)
        if t == s
        else self.move(cell, f"{p}:sq{t}to{s}", (f"{p}:finish{t}", 1), ())
        for t in range(self.num_stages)
      ]
      pod_stats = [
        stats[q] if (q, last) == cell else self.move(cell, f"{q}>{p}:stats{s}", stats[q], ())
        for q in self.pods
      ]
      extras = self.exchange.apply_refs(self, cell)
      self.node(
        cell,
        "apply",
        state=state_key(cell),
        grads=(f"{p}:finish{s}", 0),
        stats=pod_stats,
        sumsq=sumsq,
        **extras,
      )
    final = {c: (f"{c[0]}:apply{c[1]}", 0) for c in self.cells}
    norm_sums = {c: (f"{c[0]}:apply{c[1]}", 2) for c in self.cells}
    if kind != "step":
      final, norm_sums = self.exchange.outer_nodes(self, final, norm_sums)
    # Pod 0's last stage reports the metrics: the parameter and update norms of pod 0's model,
    # its stages' shares added as the gradient norm's are.
    reporter = (0, last)
    sums = [
      norm_sums[(0, t)]
      if t == last
      else self.move(reporter, f"0:norms{t}to{last}", norm_sums[(0, t)], ())
      for t in range(self.num_stages)
    ]
    metrics = self.node(reporter, "norms", metrics=(f"0:apply{last}", 1), sums=sums)
    return Program(
      nodes=interleave(list(self.queues.values())),
      outputs={**{state_key(c): ref for c, ref in final.items()}, "metrics": (metrics, 0)},
      carried=tuple(state_key(c) for c in self.cells),
    )

  def eval_program(self) -> Program:
    """Evaluation: every pod runs each microbatch forward through its stages (EF), the last
    stage's EL gives the microbatch's sums as output "eval/<p>.<m>". Each pod evaluates its own
    parameters on its share of the batch: pod 0's, except between exchanges of modes whose pods
    differ (stale, diloco)."""
    last, outputs = self.num_stages - 1, {}
    for p, s in self.cells:
      cell, state, pre = (p, s), state_key((p, s)), f"{p}:"
      for m in range(self.num_micro):
        if s == 0:
          x = self.move(cell, f"{pre}etok{m}", f"tokens/{p}.{m}", pieces_lib.TOKENS)
        else:
          x = self.move(cell, f"{pre}eact{s}.{m}", (f"{pre}EF{s - 1}.{m}", 0), pieces_lib.ACT)
        if s < last:
          self.node(cell, "EF", f".{m}", state=state, x=x)
          continue
        y = self.move(cell, f"{pre}etgt{m}", f"targets/{p}.{m}", pieces_lib.TOKENS)
        outputs[f"eval/{p}.{m}"] = (self.node(cell, "EL", f".{m}", state=state, x=x, targets=y), 0)
    return Program(nodes=interleave(list(self.queues.values())), outputs=outputs)

  def _backward(self) -> tuple[dict, dict]:
    """Every cell's microbatches in schedule order; returns each cell's summed gradients and
    each pod's loss statistics (from its last stage)."""
    running = {}
    for cell in self.cells:
      zeros = self.node(cell, "zeros", state=state_key(cell))
      running[cell] = _Running(grads=(zeros, 0), stats=(zeros, 1))
    stages = list(self.plan.stages)
    if self.virtual > 1:  # each island's chunks in the one order of the island
      for p in self.pods:
        for order in island_orders(self.schedule, stages, self.num_micro, self.virtual):
          for s, kind, m in order:
            self._emit((p, s), kind, m, running[(p, s)])
    else:
      for cell in self.cells:
        for kind, m in island_order(
          self.schedule, stages[cell[1]], self.num_stages, self.num_micro
        ):
          self._emit(cell, kind, m, running[cell])
    last = self.num_stages - 1
    return {c: r.grads for c, r in running.items()}, {
      p: running[(p, last)].stats for p in self.pods
    }

  def _emit(self, cell: tuple, kind: str, m: int, run: "_Running") -> None:
    """Cell `cell`'s node `kind` ("F", "B", "FB" or "W") of microbatch `m`, with the transfers
    it needs; `run` carries the cell's running gradient sums and statistics."""
    last, act, tokens = self.num_stages - 1, pieces_lib.ACT, pieces_lib.TOKENS
    p, s = cell
    stage = self.plan.stages[s]
    state, pre = state_key(cell), f"{p}:"
    split = splits_backward(self.schedule, stage)
    if kind == "W":
      w = self.node(cell, "W", f".{m}", state=state, grads=run.grads, **run.micro.pop(m))
      run.grads = (w, 0)
      return
    if kind == "B":
      x = (f"{pre}tok{m}", 0) if stage.first else (f"{pre}act{s}.{m}", 0)
      after = "FB" if s + 1 == last else "B"  # the next stage's backward: its input's grad
      g_in = self.piece((p, s + 1), after).output("g_in")
      g = self.move(cell, f"{pre}grad{s}.{m}", (f"{pre}{after}{s + 1}.{m}", g_in), act)
      f = self.piece(cell, "F")  # its residuals, where it keeps them for B
      saved = {"saved": (f"{pre}F{s}.{m}", f.output("saved"))} if "saved" in f.outputs else {}
      if split:  # B sends the input's gradient on; W adds the parameters' later
        name = self.node(cell, "B", f".{m}", state=state, x=x, g_out=g, **saved)
        if "saved" in (b := self.piece(cell, "B")).outputs:  # at "full", B's residuals for W
          saved = {"saved": (name, b.output("saved"))}
        run.micro[m] = {"x": x, "g_out": g, **saved}
        return
      b = self.node(cell, "B", f".{m}", state=state, x=x, g_out=g, grads=run.grads, **saved)
      run.grads = (b, self.piece(cell, "B").output("grads"))
      return
    moe_in = {}  # MoE: the running MoE stats of the stages before
    if stage.first:
      x = self.move(cell, f"{pre}tok{m}", f"tokens/{p}.{m}", tokens)
    else:
      f, name = self.piece((p, s - 1), "F"), f"{pre}F{s - 1}.{m}"
      x = self.move(cell, f"{pre}act{s}.{m}", (name, f.output("act")), act)
      if self.has_moe:
        moe_in["moe_in"] = self.move(cell, f"{pre}moe{s}.{m}", (name, f.output("moe")), ())
    if kind == "F":
      self.node(cell, "F", f".{m}", state=state, x=x, **moe_in)
      return
    y = self.move(cell, f"{pre}tgt{m}", f"targets/{p}.{m}", tokens)
    fb = self.piece(cell, "FB")
    if split:  # FB: the loss and the input's gradient; W the parameters' gradient later
      name = self.node(cell, "FB", f".{m}", state=state, x=x, targets=y, stats=run.stats, **moe_in)
      run.micro[m] = {"x": x, "targets": y, "saved": (name, fb.output("saved"))}
    else:
      refs = {"x": x, "targets": y, "grads": run.grads, "stats": run.stats, **moe_in}
      name = self.node(cell, "FB", f".{m}", state=state, **refs)
      run.grads = (name, fb.output("grads"))
    run.stats = (name, fb.output("stats"))


@dataclasses.dataclass
class _Running:
  """A cell's running gradient sums and loss statistics as its microbatches are emitted, and
  (zero_bubble) what each microbatch's W will take besides state and grads."""

  grads: tuple
  stats: tuple
  micro: dict = dataclasses.field(default_factory=dict)
