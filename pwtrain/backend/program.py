"""A Program: compiled-function nodes and cross-island transfers, in dispatch order.

Edges are `Ref`s: a string names a program input; `(node_name, i)` names output i of a node.
Because every node is compiled ahead, the controller can enqueue the whole graph before any of
it has run.
"""

import concurrent.futures
import dataclasses
from typing import Any

Ref = str | tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Executable:
  """A function lowered and compiled once for one island's mesh."""

  name: str
  island: str
  # jax.stages.Compiled, or a Future of one while the compile runs in the background (see
  # `compiled`); remote: compiled locally only if inspected; distributed, an island of another
  # process: usually its outline.Outline (shapes and shardings only)
  compiling: Any
  num_outputs: int
  remote: Any = None  # remote islands: the worker's copy (backend.remote.dispatch)
  donate_argnums: tuple[int, ...] = ()  # arguments whose buffers it may reuse (then gone)

  @property
  def compiled(self):
    """The compiled function (or its stand-in above); waits for a background compile to end,
    and raises its error if it failed."""
    if isinstance(self.compiling, concurrent.futures.Future):
      return self.compiling.result()
    return self.compiling

  def memory_analysis(self):
    return self.compiled.memory_analysis()


@dataclasses.dataclass(frozen=True)
class Node:
  """Run `executable` (compiled for its island) on the values named by `args`."""

  name: str
  executable: Executable
  args: tuple[Ref, ...]

  @property
  def island(self) -> str:
    return self.executable.island

  @property
  def num_outputs(self) -> int:
    return self.executable.num_outputs


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Move the value named by `src` onto `island` with `sharding` (activations, gradients)."""

  name: str
  src: Ref
  island: str
  sharding: Any
  num_outputs: int = 1


@dataclasses.dataclass(frozen=True)
class Latest:
  """A program input read when the node that takes it launches: the newest value published under
  `name` on the node's island (Controller.publish, or the carried outputs of the programs run
  while the controller publishes: backend/scheduler.py), or with `keys` the dict of those
  entries of it. Nodes only: a transfer would read it on its destination island."""

  name: str
  keys: tuple[str, ...] = ()


class NotPublished(LookupError):
  """A node read a `Latest` name that nothing has published on its island yet."""


@dataclasses.dataclass(frozen=True)
class Program:
  nodes: tuple[Node | Transfer, ...]
  outputs: dict[str, Ref]
  # Outputs fed (and donated) into the next program, e.g. the train state. The controller never
  # waits on them: once donated they are gone, and the other outputs mark completion.
  carried: tuple[str, ...] = ()

  def __post_init__(self):
    seen: set[str] = set()
    for node in self.nodes:
      refs = node.args if isinstance(node, Node) else (node.src,)
      for ref in refs:
        assert isinstance(ref, str) or ref[0] in seen, f"{node.name} reads {ref} before it exists"
      assert node.name not in seen, f"duplicate node {node.name}"
      seen.add(node.name)

  @property
  def inputs(self) -> set[str]:
    names = set()
    for node in self.nodes:
      refs = node.args if isinstance(node, Node) else (node.src,)
      names.update(r for r in refs if isinstance(r, str))
    return names
