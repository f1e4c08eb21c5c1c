"""A cell's compiled pieces, with named inputs.

A piece is one function of a cell (pod p, stage s) compiled once for the cell's island. Its
inputs are named, in the order it takes them; a name may stand for a list of values (every
pod's loss statistics, say), one argument each. The code that compiles a piece and the code that
wires its node into the step use the same names, so no one slices arguments by position.

Per cell and microbatch m (node names are "<p>:<kind><s>[.<m>]"):
  F    forward: input activation (or tokens) -> output activation
  B    backward: pulls back the next stage's activation gradient and adds the parameter
       gradients into the stage's running sums. What it differentiates through depends on
       `parallel.stage_remat` (STAGE_REMAT):
         full  B recomputes the stage's forward from its saved input (GPipe's
               re-materialisation): a stage holds one input per microbatch in flight
         none  F also returns what the stage's VJP keeps (its residuals: what model.remat
               keeps of every block; an unrolled model at remat "none" keeps every
               intermediate autodiff saves, more than XLA's fusion leaves in one program), B
               applies the VJP to them with no recomputation: a stage holds its residuals per
               microbatch in flight, and does the single device's work
       The chunks of exchange.mode="overlapped" are stages too.
  FB   on the last stage: forward, loss and backward in one piece
and once per step: init, zeros (the running sums), emb (the shared embedding's gradient half),
finish (tie the embedding halves; the squared norm), apply (the optimizer update; the stage's
share of the parameter and update norms), norms (pod 0's last stage: the step's metrics with
those norms, from every stage's share), plus the exchange's own pieces (exchange/*.py).
Evaluation has its own two, compiled on first use:
  EF   forward at inference (MoE at eval capacity, no jitter): input -> output activation
  EL   on the last stage: forward and loss -> the microbatch's {"ce_sum", "z_sum", "tokens"}
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain import sharding as sharding_lib
from pwtrain import step as step_lib
from pwtrain.backend import Controller, Executable
from pwtrain.backend.outline import KEPT
from pwtrain.models import lm_loss
from pwtrain.models import moe as moe_lib

# parallel.stage_remat: what a pipeline stage keeps for its backward (see F and B above).
STAGE_REMAT = ("full", "none")
ACT = ("batch", "length", "embed")  # logical axes of a stage's input/output activation
TOKENS = ("batch", "length")


@dataclasses.dataclass(frozen=True)
class Piece:
  """An executable, the names of its inputs: (name, list length, or None for one value), and
  the names of its outputs where a node's consumers pick them by name: F's are f_outputs; B's
  "grads" (the running gradient sums) and, after the first stage, "g_in" (the input's gradient,
  sent to the stage before); FB's "grads", "stats" (the running loss statistics) and "g_in"."""

  executable: Executable
  signature: tuple[tuple[str, int | None], ...]
  outputs: tuple[str, ...] = ()

  def output(self, name: str) -> int:
    """The position of output `name` (the index of a Ref to it)."""
    return self.outputs.index(name)

  def args(self, refs: dict) -> tuple:
    """The node's positional refs from {input name: ref, or a list of refs}."""
    names = [name for name, _ in self.signature]
    assert set(refs) == set(names), f"{self.executable.name}: inputs {sorted(refs)} != {names}"
    out = []
    for name, length in self.signature:
      if length is None:
        out.append(refs[name])
      else:
        assert len(refs[name]) == length, f"{self.executable.name}: {name} needs {length}"
        out.extend(refs[name])
    return tuple(out)

  def input_sharding(self, name: str, index: int = 0):
    """The compiled sharding of input `name` (element `index` of a list input)."""
    position = 0
    for other, length in self.signature:
      if other == name:
        return self.executable.compiled.input_shardings[0][position + index]
      position += 1 if length is None else length
    raise KeyError(name)

  @property
  def out_abstract(self):
    """The outputs as ShapeDtypeStructs with their compiled shardings (None where the piece is
    outlined and the sharding unknown here: backend/outline.py)."""
    return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      self.executable.compiled.out_info,
    )


def compile_piece(
  controller: Controller, name, fn, island: str, mesh, inputs: dict, *, donate=(), outputs=(), **kw
) -> Piece:
  """Compiles `fn(**inputs)` for abstract `inputs` ({name: value or list of values}); `donate`
  names the inputs whose buffers the piece may reuse, `outputs` the outputs of its tuple."""
  signature = tuple((k, len(v) if isinstance(v, list) else None) for k, v in inputs.items())
  flat, donate_argnums = [], []
  for key, value in inputs.items():
    for v in value if isinstance(value, list) else [value]:
      if key in donate:
        donate_argnums.append(len(flat))
      flat.append(v)

  def positional(*args):
    named, it = {}, iter(args)
    for key, length in signature:
      named[key] = next(it) if length is None else [next(it) for _ in range(length)]
    return fn(**named)

  exe = controller.compile(
    name, positional, island, tuple(flat), mesh=mesh, donate_argnums=tuple(donate_argnums), **kw
  )
  return Piece(exe, signature, tuple(outputs))


@dataclasses.dataclass
class CellPieces:
  """One cell's island, mesh and abstract values; compiles its pieces into `pieces`."""

  key: tuple  # (pod, stage)
  stage: Any  # stages.Stage
  num_stages: int
  island: Any  # backend.Island
  mesh: Any
  fns: step_lib.ModelFns  # the stage's model
  state_abs: dict  # the cell's state, with shardings
  shardings: dict  # the state's shardings
  stats_abs: dict  # the loss statistics (and MoE stats) carried through the step
  tokens_abs: Any
  act_abs: Any
  controller: Controller
  pieces: dict  # (kind, pod, stage) -> Piece, shared by every cell

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  @property
  def grads_abs(self) -> dict:
    return self.state_abs["params"]

  @property
  def grads_sharding(self) -> dict:
    return self.shardings["params"]

  @property
  def x_abs(self):
    """The stage's input: tokens on the first stage, else the previous stage's activation."""
    return self.tokens_abs if self.stage.first else self.act_abs

  @property
  def moe_abs(self) -> dict:
    return {k: v for k, v in self.stats_abs.items() if k in moe_lib.STAT_KEYS}

  def sharding_of(self, tree):
    return jax.tree.map(lambda a: a.sharding, tree)

  def compile(self, kind: str, fn, inputs: dict, **kw) -> Piece:
    p, s = self.key
    piece = compile_piece(
      self.controller, f"{p}:{kind}{s}", fn, self.island.name, self.mesh, inputs, **kw
    )
    self.pieces[(kind, p, s)] = piece
    return piece


def cell_pieces(config, *, mesh, **fields) -> "CellPieces":
  """A CellPieces of `fields` (its other fields, by name) with the step's abstract
  activations, tokens and statistics on `mesh`."""
  replicated = NamedSharding(mesh, PartitionSpec())
  mb = config.train.global_batch // config.parallel.pods // config.train.num_microbatches
  seq = config.data.seq_len
  tokens = jax.ShapeDtypeStruct(
    (mb, seq), np.int32, sharding=sharding_lib.named_sharding(mesh, TOKENS)
  )
  act = jax.ShapeDtypeStruct(
    (mb, seq, config.model.d_model),
    jnp.dtype(config.model.dtype),
    sharding=sharding_lib.named_sharding(mesh, ACT),
  )
  stats = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
    jax.eval_shape(lambda: zero_stats(config.moe.num_experts)),
  )
  return CellPieces(mesh=mesh, stats_abs=stats, tokens_abs=tokens, act_abs=act, **fields)


def zero_stats(num_experts: int) -> dict:
  """The running loss statistics of a step (and MoE stats), all zero."""
  return {
    **{k: jnp.zeros((), jnp.float32) for k in step_lib.STAT_KEYS},
    **moe_lib.zero_stats(num_experts),
  }


@dataclasses.dataclass
class Residuals:
  """How a stage's VJP goes from its F piece to its B piece (`parallel.stage_remat="none"`).

  jax.vjp's function is a pytree whose leaves are what the backward needs. Some of them are
  F's own inputs (the parameters, the input activation), matched by identity while F is
  traced: those B already takes, so F does not return them again (a copy per microbatch). F
  returns the others, `saved`, as one tuple. Both are recorded by tracing F (`save`), so B can be
  traced (`vjp`) only after F has been, in this process: compile_stage compiles F first.
  """

  treedef: Any = None
  sources: tuple = ()  # per leaf of the VJP: ("input", i) into the inputs, or ("saved", i)

  def save(self, vjp, inputs) -> tuple:
    """The VJP's leaves that are not leaves of `inputs` (F's outputs); records the rest."""
    leaves, self.treedef = jax.tree.flatten(vjp)
    flat = jax.tree.leaves(inputs)
    saved, sources = [], []
    for leaf in leaves:
      i = next((i for i, a in enumerate(flat) if a is leaf), None)
      sources.append(("saved", len(saved)) if i is None else ("input", i))
      if i is None:
        saved.append(leaf)
    self.sources = tuple(sources)
    return tuple(saved)

  def vjp(self, saved: tuple, inputs):
    """The VJP function again, from F's `saved` and the same `inputs` (B's)."""
    assert self.treedef is not None, "F is traced before B"
    flat = jax.tree.leaves(inputs)
    leaves = [flat[i] if kind == "input" else saved[i] for kind, i in self.sources]
    return jax.tree.unflatten(self.treedef, leaves)


def f_outputs(moe, stage_remat: str) -> tuple[str, ...]:
  """The names of F's outputs, in order: "act" (the output activation), "moe" (the running MoE
  stats, with MoE layers), "saved" (the VJP's residuals, at stage_remat="none")."""
  return (
    ("act",) + (("moe",) if moe is not None else ()) + (("saved",) if stage_remat == "none" else ())
  )


def compile_stage(cell: CellPieces, moe, z_loss: float, stage_remat: str) -> None:
  """A stage's F and B pieces, or its FB on the last stage.

  F returns the stage's output activation; B is its VJP (a first stage's tokens get no
  gradient), recomputed from F's input or rebuilt from F's residuals as `stage_remat` says
  (STAGE_REMAT, and the module docstring); FB differentiates the LM loss. With MoE layers
  (`moe` set) a stage also has its weighted aux losses: its objective is (output, aux), B's
  cotangents are (the next stage's activation gradient, 1) and FB adds its aux losses to the
  loss. F then also returns the running MoE stats (the previous stages', carried in as
  `moe_in`, plus its own), so FB's stats cover every stage and its loss_sum every stage's
  weighted aux losses. F's outputs are a tuple named by f_outputs (Piece.output).
  """
  stage, fns = cell.stage, cell.fns
  act_sharding = cell.act_abs.sharding
  moe_in = {} if stage.first or moe is None else {"moe_in": cell.moe_abs}
  argnums = (0,) if stage.first else (0, 1)  # tokens are not differentiable

  def forward(params, x):
    if moe is None:
      return fns.module(params)(x), {}
    rngs = moe_lib.jitter_rngs(moe, x)
    return fns.module(params).forward(x, train=True, rngs=rngs)

  def objective(params, x):
    out, stats = forward(params, x)
    if moe is None:
      return out, stats
    return (out, moe_lib.weighted_aux(moe, stats)), stats

  if stage.last:

    def fb_fn(state, x, targets, grads, stats, moe_in=None):
      def loss_fn(params, x):
        out, own = forward(params, x)
        total, lm = lm_loss(out, targets, z_loss=z_loss)
        if moe is not None:
          total = total + moe_lib.weighted_aux(moe, own)
        return total, (lm, own)

      (total, (lm, own)), g = jax.value_and_grad(loss_fn, argnums, has_aux=True)(state["params"], x)
      if moe_in is not None:  # earlier stages' aux losses were differentiated there
        own = moe_lib.add_stats(moe_in, own)
        total = total + moe_lib.weighted_aux(moe, moe_in)
      grads = jax.tree.map(jnp.add, grads, g[0])
      stats = jax.tree.map(jnp.add, stats, {"loss_sum": total, **lm, **own})
      return (grads, stats) if stage.first else (grads, stats, g[1])

    cell.compile(
      "FB",
      fb_fn,
      {
        "state": cell.state_abs,
        "x": cell.x_abs,
        "targets": cell.tokens_abs,
        "grads": cell.grads_abs,
        "stats": cell.stats_abs,
        **moe_in,
      },
      out_shardings=(cell.grads_sharding, cell.sharding_of(cell.stats_abs))
      + (() if stage.first else (act_sharding,)),
      donate=("grads", "stats"),
      outputs=("grads", "stats") + (() if stage.first else ("g_in",)),
    )
    return

  keep = stage_remat == "none"
  residuals = Residuals()
  outputs = f_outputs(moe, stage_remat)
  cotangent_of = lambda g_out: g_out if moe is None else (g_out, jnp.ones((), jnp.float32))
  primals = lambda state, x: (state["params"], x)[: len(argnums)]

  def differentiated(x):
    """What B differentiates: the objective of (params, x), or of params on the first stage
    (its input is tokens)."""
    return (lambda params: objective(params, x)) if stage.first else objective

  def f_fn(state, x, moe_in=None):
    named = {}
    if keep:
      out, vjp, own = jax.vjp(differentiated(x), *primals(state, x), has_aux=True)
      named["act"] = out if moe is None else out[0]  # objective's (output, aux)
      named["saved"] = residuals.save(vjp, (state["params"], x))
    else:
      named["act"], own = forward(state["params"], x)
    if moe is not None:
      named["moe"] = own if moe_in is None else moe_lib.add_stats(moe_in, own)
    return tuple(named[name] for name in outputs)

  # KEPT: the residuals' shardings are the compiler's choice, and only B, on the same island,
  # reads them (a process that does not run the island need not compile F to learn them).
  shardings = {"act": act_sharding, "moe": cell.sharding_of(cell.moe_abs), "saved": KEPT}
  f_piece = cell.compile(
    "F",
    f_fn,
    {"state": cell.state_abs, "x": cell.x_abs, **moe_in},
    out_shardings=tuple(shardings[name] for name in outputs),
    outputs=outputs,
  )

  def b_fn(state, x, g_out, grads, saved=None):
    if keep:
      vjp = residuals.vjp(saved, (state["params"], x))
    else:
      _, vjp, _ = jax.vjp(differentiated(x), *primals(state, x), has_aux=True)
    g_params, *g_in = vjp(cotangent_of(g_out))
    return (jax.tree.map(jnp.add, grads, g_params), *g_in)

  inputs = {
    "state": cell.state_abs,
    "x": cell.x_abs,
    "g_out": cell.act_abs,
    "grads": cell.grads_abs,
  }
  if keep:
    inputs["saved"] = f_piece.out_abstract[f_piece.output("saved")]
  cell.compile(
    "B",
    b_fn,
    inputs,
    out_shardings=(cell.grads_sharding,) + (() if stage.first else (act_sharding,)),
    donate=("grads",),
    outputs=("grads",) + (() if stage.first else ("g_in",)),
  )


def compile_eval(cell: CellPieces, z_loss: float) -> None:
  """The cell's EF piece, or its EL on the last stage (see the module docstring)."""

  def forward(state, x):
    return cell.fns.module(state["params"]).forward(x, train=False)[0]

  if cell.stage.last:

    def el_fn(state, x, targets):
      return lm_loss(forward(state, x), targets, z_loss=z_loss)[1]

    stats = {k: v for k, v in cell.stats_abs.items() if k in step_lib.EVAL_KEYS}
    inputs = {"state": cell.state_abs, "x": cell.x_abs, "targets": cell.tokens_abs}
    cell.compile("EL", el_fn, inputs, out_shardings=cell.sharding_of(stats))
    return
  inputs = {"state": cell.state_abs, "x": cell.x_abs}
  cell.compile("EF", forward, inputs, out_shardings=cell.act_abs.sharding)
