"""Wires a step's nodes: every cell's compiled pieces (builder.py) as nodes and transfers, in
each island's schedule order, merged into one Program.

Cell (p, s) is stage s of pod p, on the island the plan gives it. Besides the stage's pieces
(pieces.py) the step moves activations forward, activation gradients backward, the shared
embedding's gradient halves between the first and last stage, the loss statistics and squared
norms to every cell, each of the reporting pod's stages' share of the parameter and update
norms to its last stage (which reports the metrics: pod 0, or the lowest live pod where pod 0 is
hosted), and whatever the exchange sends between pods
(exchange/*.py). Node names are prefixed with the pod ("1:F0.3"); transfers are named for what
they carry ("1:act2.0", "0>1:g1" from pod 0 to pod 1). Each island's nodes follow the schedule
(schedule.py; interleaved: several chunks' cells per island), and each island's scheduler
launches them in that order as their inputs appear.
"""

import dataclasses

import jax

from pwtrain import objectives
from pwtrain import sharding as sharding_lib
from pwtrain.backend import Node, Program, Transfer
from pwtrain.models import family
from pwtrain.models import moe as moe_lib
from pwtrain.parallel.pipeline import pieces as pieces_lib
from pwtrain.parallel.pipeline.schedule import (
  interleave,
  island_order,
  island_orders,
  splits_backward,
)
from pwtrain.parallel.pipeline.state import state_key


class ProgramBuilder:
  """Emits the step's nodes cell by cell, then interleaves them into one dispatch order.

  `hosts` ({pod: its host pod for each microbatch}, elastic pods): each of those pods is hosted
  by live pods: microbatch m of each of its cells runs on the islands of the same stage of host
  m, with the host's pieces on the host's state (the pods' states are equal:
  PipelineProgram.hosted).
  Its running gradient sums and statistics follow its microbatches from host to host, so they
  add up in the order they would on its own islands, and end on its last microbatch's host (its
  home), whence they go into the sums as its own would. It applies no update, keeps no state."""

  def __init__(self, plan, pieces: dict, config, hosts: dict | None = None):
    self.plan, self.pieces, self.exchange = plan, pieces, plan.exchange
    self.hosts = hosts or {}
    self._micro = None  # the microbatch being emitted: where a hosted cell's node runs
    self.cells = list(plan.cells)  # every pod's: each one runs its microbatches
    self.owners = [c for c in self.cells if c[0] not in self.hosts]  # apply an update
    self.pods = sorted({p for p, _ in self.cells})
    self.num_stages = plan.num_stages
    self.num_micro = config.train.num_microbatches
    self.schedule = config.parallel.schedule
    self.has_moe = moe_lib.enabled(config.moe)
    self.label_columns = objectives.make(config).label_columns
    self.tied_output = family.of(config.model).tied  # the embedding is the output layer too
    self.virtual = plan.virtual_stages
    # One node list per cell, merged by `interleave`; interleaved, one per island (its chunks'
    # nodes in the schedule's order).
    self.queues: dict = {self.queue_of(c): [] for c in self.cells}
    self.kind = "step"  # the program kind being built (exchange.program_kinds)

  def queue_of(self, cell: tuple) -> tuple:
    return (cell[0], cell[1] % (self.num_stages // self.virtual)) if self.virtual > 1 else cell

  def host(self, cell: tuple) -> tuple:
    """The cell whose island, pieces and state `cell` runs with: its own, unless hosted (then
    the current microbatch's host's, or outside microbatches its home's)."""
    pods = self.hosts.get(cell[0])
    if pods is None:
      return cell
    return (pods[-1 if self._micro is None else self._micro], cell[1])

  def state_key(self, cell: tuple) -> str:
    return state_key(self.host(cell))

  def piece(self, cell: tuple, kind: str) -> pieces_lib.Piece:
    return self.pieces[(kind, *self.host(cell))]

  def move(self, cell, name, src, names=None, sharding=None):
    """Transfer `src` onto `cell`'s island, sharded by logical `names` (or `sharding`)."""
    if sharding is None:
      sharding = sharding_lib.named_sharding(self.plan.mesh(self.host(cell)), names)
    self.queues[self.queue_of(cell)].append(
      Transfer(name, src, self.plan.cells[self.host(cell)].name, sharding)
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

    # A shared embedding: each end sends its (pod-summed) half of the gradient to the other.
    shared = self.num_stages > 1 and self.tied_output
    tied = [c for c in self.owners if shared and c[1] in (0, last)]
    for cell in tied:
      self.node(cell, "emb", grads=grads[cell])
    for p, s in self.owners:
      refs = {"grads": grads[(p, s)]}
      if (p, s) in tied:
        other = last if s == 0 else 0
        src = (f"{p}:emb{other}", 0)
        refs["other"] = self.move((p, s), f"{p}:emb{other}to{s}", src, ("vocab", "embed"))
      self.node((p, s), "finish", **refs)

    # Every cell clips by the same global norm and normalises by the same token count.
    for p, s in self.owners:
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
        state=self.state_key(cell),
        grads=(f"{p}:finish{s}", 0),
        stats=pod_stats,
        sumsq=sumsq,
        **extras,
      )
    final = {c: (f"{c[0]}:apply{c[1]}", 0) for c in self.owners}
    norm_sums = {c: (f"{c[0]}:apply{c[1]}", 2) for c in self.owners}
    if kind != "step":
      final, norm_sums = self.exchange.outer_nodes(self, final, norm_sums)
    # The first pod with state (pod 0, unless it is hosted) reports the metrics: the parameter
    # and update norms of its model, its stages' shares added as the gradient norm's are. The
    # pods' states and metrics are the same, so any reports what pod 0 would.
    r = min(p for p, _ in self.owners)
    reporter = (r, last)
    sums = [
      norm_sums[(r, t)]
      if t == last
      else self.move(reporter, f"{r}:norms{t}to{last}", norm_sums[(r, t)], ())
      for t in range(self.num_stages)
    ]
    metrics = self.node(reporter, "norms", metrics=(f"{r}:apply{last}", 1), sums=sums)
    return Program(
      nodes=interleave(list(self.queues.values())),
      outputs={**{state_key(c): ref for c, ref in final.items()}, "metrics": (metrics, 0)},
      carried=tuple(state_key(c) for c in self.owners),
    )

  def eval_program(self) -> Program:
    """Evaluation: every pod runs each microbatch forward through its stages (EF), the last
    stage's EL gives the microbatch's sums as output "eval/<p>.<m>". Each pod evaluates its own
    parameters on its share of the batch: pod 0's, except between exchanges of modes whose pods
    differ (stale, diloco)."""
    last, outputs = self.num_stages - 1, {}
    for p, s in self.cells:
      cell, pre = (p, s), f"{p}:"
      for m in range(self.num_micro):
        self._micro = m
        state = self.state_key(cell)
        if s == 0:
          x = self.move(cell, f"{pre}etok{m}", f"tokens/{p}.{m}", pieces_lib.TOKENS)
        else:
          x = self.move(cell, f"{pre}eact{s}.{m}", (f"{pre}EF{s - 1}.{m}", 0), pieces_lib.ACT)
        if s < last:
          self.node(cell, "EF", f".{m}", state=state, x=x)
          continue
        y = self.move(cell, f"{pre}etgt{m}", f"targets/{p}.{m}", pieces_lib.TOKENS)
        outputs[f"eval/{p}.{m}"] = (self.node(cell, "EL", f".{m}", state=state, x=x, targets=y), 0)
    self._micro = None
    return Program(nodes=interleave(list(self.queues.values())), outputs=outputs)

  def _backward(self) -> tuple[dict, dict]:
    """Every cell's microbatches in schedule order; returns each cell's summed gradients and
    each pod's loss statistics (from its last stage)."""
    running = {}
    for cell in self.cells:
      self._micro = 0  # a hosted cell's sums start on its first microbatch's host
      zeros = self.node(cell, "zeros", state=self.state_key(cell))
      at = self.host(cell)
      running[cell] = _Running(grads=(zeros, 0), stats=(zeros, 1), at={"grads": at, "stats": at})
      self._micro = None
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
    for cell in self.cells:  # a hosted cell's sums go home
      sums = ("grads", "stats") if cell[1] == last else ("grads",)
      self._follow(cell, running[cell], "home", "zeros", sums)
    return {c: r.grads for c, r in running.items()}, {
      p: running[(p, last)].stats for p in self.pods
    }

  def _follow(self, cell: tuple, run: "_Running", where: str, kind: str, sums: tuple) -> None:
    """A hosted cell's running `sums` ("grads", "stats") moved onto its current host's island
    (`where` names the transfers), laid out as that host's piece `kind` takes or makes them."""
    here = self.host(cell)
    for i, name in enumerate(("grads", "stats")):
      if name in sums and run.at[name] != here:
        piece = self.piece(cell, kind)
        if kind == "zeros":  # as zeros makes them on this island
          sharding = jax.tree.map(lambda a: a.sharding, piece.out_abstract[i])
        else:
          sharding = piece.input_sharding(name)
        name_here = f"{cell[0]}:{name}{cell[1]}.{where}"
        setattr(run, name, self.move(cell, name_here, getattr(run, name), sharding=sharding))
        run.at[name] = here

  def _emit(self, cell: tuple, kind: str, m: int, run: "_Running") -> None:
    """Cell `cell`'s node `kind` ("F", "B", "FB" or "W") of microbatch `m`, with the transfers
    it needs; `run` carries the cell's running gradient sums and statistics."""
    self._micro = m
    try:
      split = splits_backward(self.schedule, self.plan.stages[cell[1]])
      takes = {"W": ("grads",), "B": () if split else ("grads",)}
      takes["FB"] = ("stats",) if split else ("grads", "stats")
      self._follow(cell, run, str(m), kind, takes.get(kind, ()))
      self._emit_here(cell, kind, m, run, split)
    finally:
      self._micro = None

  def _emit_here(self, cell: tuple, kind: str, m: int, run: "_Running", split: bool) -> None:
    last, act, tokens = self.num_stages - 1, pieces_lib.ACT, pieces_lib.TOKENS
    p, s = cell
    stage = self.plan.stages[s]
    state, pre = self.state_key(cell), f"{p}:"
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
    y = [  # the objective's label columns
      self.move(cell, f"{pre}{'tgt' if c == 'targets' else c}{m}", f"{c}/{p}.{m}", tokens)
      for c in self.label_columns
    ]
    fb = self.piece(cell, "FB")
    if split:  # FB: the loss and the input's gradient; W the parameters' gradient later
      name = self.node(cell, "FB", f".{m}", state=state, x=x, labels=y, stats=run.stats, **moe_in)
      run.micro[m] = {"x": x, "labels": y, "saved": (name, fb.output("saved"))}
    else:
      refs = {"x": x, "labels": y, "grads": run.grads, "stats": run.stats, **moe_in}
      name = self.node(cell, "FB", f".{m}", state=state, **refs)
      run.grads = (name, fb.output("grads"))
    run.stats = (name, fb.output("stats"))


@dataclasses.dataclass
class _Running:
  """A cell's running gradient sums and loss statistics as its microbatches are emitted, the
  cell whose island holds each (`at`: a hosted cell's move), and (zero_bubble) what each
  microbatch's W will take besides state and grads."""

  grads: tuple
  stats: tuple
  at: dict
  micro: dict = dataclasses.field(default_factory=dict)
