"""A cell's compiled pieces, with named inputs.

A piece is one function of a cell (pod p, stage s) compiled once for the cell's island. Its
inputs are named, in the order it takes them; a name may stand for a list of values (every
pod's loss statistics, say), one argument each. The code that compiles a piece and the code that
wires its node into the step use the same names, so no one slices arguments by position.

The stage's own computation per microbatch (F, B, FB, W) and at evaluation (EF, EL) is
compute.py's; besides those a cell has, once per step: init, zeros (the running sums), emb (the
shared embedding's gradient half), finish (tie the embedding halves; the squared norm), apply
(the optimizer update; the stage's share of the parameter and update norms), norms (the
reporting pod's last stage: the step's metrics with those norms, from every stage's share; pod
0's, or with elastic pods every pod's), plus the exchange's own pieces (exchange/*.py).
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
from pwtrain.models import moe as moe_lib

# parallel.stage_remat: what a pipeline stage keeps for its backward (compute.py: F and B).
STAGE_REMAT = ("full", "none")
ACT = ("batch", "length", "embed")  # logical axes of a stage's input/output activation
TOKENS = ("batch", "length")


@dataclasses.dataclass(frozen=True)
class Piece:
  """An executable, the names of its inputs: (name, list length, or None for one value), and
    the names of its outputs where a node's consumers pick them by name: F's are compute.f_outputs;
  B's
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
  labels_abs: list  # a microbatch's label columns (objective.label_columns, in that order)
  objective: Any  # the run's objective (objectives.py)
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


def cell_pieces(config, objective, *, mesh, **fields) -> "CellPieces":
  """A CellPieces of `fields` (its other fields, by name) with the run's `objective` and the
  step's abstract activations, tokens, labels and statistics on `mesh`."""
  replicated = NamedSharding(mesh, PartitionSpec())
  mb = config.train.global_batch // config.parallel.pods // config.train.num_microbatches
  seq = config.data.seq_len
  column = lambda dtype: jax.ShapeDtypeStruct(
    (mb, seq), dtype, sharding=sharding_lib.named_sharding(mesh, TOKENS)
  )
  tokens = column(np.int32)
  labels = [column(objective.columns[k]) for k in objective.label_columns]
  act = jax.ShapeDtypeStruct(
    (mb, seq, config.model.d_model),
    jnp.dtype(config.model.dtype),
    sharding=sharding_lib.named_sharding(mesh, ACT),
  )
  stats = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
    jax.eval_shape(lambda: zero_stats(objective, config.moe.num_experts)),
  )
  return CellPieces(
    mesh=mesh,
    stats_abs=stats,
    tokens_abs=tokens,
    labels_abs=labels,
    objective=objective,
    act_abs=act,
    **fields,
  )


def zero_stats(objective, num_experts: int) -> dict:
  """The running loss statistics of a step (the objective's, and MoE stats), all zero."""
  return {**objective.zero_stats(), **moe_lib.zero_stats(num_experts)}
