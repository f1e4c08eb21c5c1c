"""What a process knows of a piece it does not run (distributed mode): its `Outline`.

In distributed mode every process walks every program but launches only its own islands' nodes
(dispatch.LocalDispatcher). Of a piece of another process's island it reads only shapes and
shardings: its outputs' (the stand-ins its node leaves, backend/pulls.py's layouts, the
abstract inputs of the pieces built from it) and its inputs' (where a transfer to it lands).
Tracing the function tells those without compiling it wherever the caller fixed the outputs'
shardings (`out_shardings`). An output's sharding left to the compiler (None) only compiling
tells, so `outline` gives None for such a piece and the dispatcher compiles it as where it runs;
except an output marked `KEPT`: the compiler chooses its sharding too, but only pieces of its
own island read it (a stage's residuals, parallel/pipeline/pieces.py), so another process
never needs that sharding, and the Outline leaves it unknown (None). `check_reads` makes sure
no transfer or program output reads such an unknown.
"""

import dataclasses
from typing import Any

import jax

from pwtrain.backend.program import Node, Program, Transfer


class _Kept:
  def __repr__(self) -> str:
    return "KEPT"


# An `out_shardings` leaf: the compiler's choice (None to jax.jit), of an output that only
# pieces of its own island read (the module docstring).
KEPT = _Kept()


def without_kept(out_shardings):
  """`out_shardings` with every KEPT as None, as jax.jit takes it."""
  return jax.tree.map(lambda s: None if s is KEPT else s, out_shardings, is_leaf=_is_none)


@dataclasses.dataclass(frozen=True)
class Outline:
  """The part of a jax.stages.Compiled that the builders and the dispatcher read of a piece
  another process runs, as its compile answers it there: `out_info` (its outputs as
  ShapeDtypeStructs with shardings, in its output tree), `output_shardings` (their shardings)
  and `input_shardings` ((per positional argument its tree of shardings, {})). Unknown here,
  and None: a KEPT output's sharding, and an argument's that was given none (a KEPT output of
  another piece of its island); also where the compile answers None (an argument the piece
  does not read) the Outline has the sharding it was given. It cannot run, and has no memory
  or cost analysis."""

  name: str
  out_info: Any
  input_shardings: tuple

  @property
  def output_shardings(self):
    return jax.tree.map(lambda info: info.sharding, self.out_info)

  def __call__(self, *args):
    raise RuntimeError(f"{self.name} runs on another process's island; this one has its outline")

  def memory_analysis(self):
    raise RuntimeError(f"{self.name} was not compiled here: another process's island runs it")


def outline(name: str, traced: jax.stages.Traced, args: tuple, out_shardings) -> Outline | None:
  """The Outline of `traced` (a function jitted with no in_shardings and `out_shardings`
  without KEPT, traced for abstract `args`), or None when the compiler would choose the
  sharding of an output `out_shardings` does not mark KEPT."""
  marks = jax.tree.broadcast(out_shardings, traced.out_info, is_leaf=_is_none)
  kept = [mark is KEPT for mark in jax.tree.leaves(marks, is_leaf=_is_none)]
  outputs = jax.tree.leaves(traced.out_info)
  assert len(kept) == len(outputs), name
  if any(o.sharding is None and not k for o, k in zip(outputs, kept, strict=True)):
    return None
  out_info = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), traced.out_info
  )
  inputs = jax.tree.map(lambda a: getattr(a, "sharding", None), tuple(args))
  return Outline(name, out_info, (inputs, {}))


def check_reads(program: Program) -> None:
  """Raises ValueError where a transfer or a program output of `program` reads an output of
  an outlined node whose sharding is unknown here (KEPT, and read off its island after all)."""
  outlined = {
    n.name: n.executable.compiled
    for n in program.nodes
    if isinstance(n, Node) and isinstance(n.executable.compiled, Outline)
  }
  reads = [(t.name, t.src) for t in program.nodes if isinstance(t, Transfer)]
  reads += list(program.outputs.items())
  for reader, ref in reads:
    if isinstance(ref, str) or ref[0] not in outlined:
      continue
    info = outlined[ref[0]].out_info
    info = info[ref[1]] if isinstance(info, tuple) else info
    if any(i.sharding is None for i in jax.tree.leaves(info)):
      raise ValueError(
        f"{reader} reads output {ref[1]} of {ref[0]}, which its piece marks KEPT (read on its "
        "own island only): another process does not know its sharding (backend/outline.py)"
      )


def _is_none(x) -> bool:
  return x is None
