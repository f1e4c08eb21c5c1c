"""A checkpoint's train state in parts, one per island, each written by the worker that holds it.

Remote mode never moves the state through the controller to save it. Each island worker writes
its island's arrays as a complete Orbax checkpoint of its own (phase one, `Save` in the worker
protocol) under `<checkpoints>.pending/`; only when every worker has reported success does the
controller commit the step (phase two): one Orbax save of the step whose "parts" item moves the
finished parts in, next to the data iterator and integrity items. Orbax writes that step to a
temporary directory and renames it when complete, so a step is either absent or whole: a worker
or controller that dies mid-save leaves only pending files, which resume never reads.

Layout: `<step>/parts/<island>/` per island, each a standard Orbax checkpoint of a nested dict
whose paths are the arrays' paths in the whole-model state (`params/blocks/0/attn/wq`, ...), so
any layout, embedded or remote, restores it (see Checkpointer.restore).
"""

import dataclasses
import os
import shutil
from typing import ClassVar, Protocol, runtime_checkable

import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath


@runtime_checkable
class PendingParts(Protocol):
  """Phase one of a save in parts, under way: the parts it writes and a wait for them."""

  parts: dict[str, str]  # part name -> its directory; the commit moves each into the step

  def wait(self) -> dict[str, int]:
    """{array path: fingerprint} once every part is written; raises if one could not be."""
    ...


@runtime_checkable
class PartWriter(Protocol):
  """Who writes a state's parts: `writer(state, pending)` starts phase one of a save of
  `state` into the directory `pending` and returns at once with its `PendingParts`.

  `local_arrays` says what it saves: True for a state of this process's jax.Arrays written by
  the processes of a distributed run together (every process writes into the same `pending`,
  saves coming in the same order on every process: `process_parts.ProcessParts`); False for a
  state of references to arrays held elsewhere, each save in a fresh `pending` (remote island
  workers: `backend.remote.saves.PendingSave`)."""

  local_arrays: ClassVar[bool]

  def __call__(self, state, pending: str) -> PendingParts: ...


def insert(tree: dict, name: str, value) -> None:
  """Puts `value` at the "/"-separated path `name` of a nested dict."""
  *parents, last = name.split("/")
  for key in parents:
    tree = tree.setdefault(key, {})
  if last in tree:
    raise ValueError(f"{name!r} appears twice")
  tree[last] = value


def flatten(tree, prefix: str = "") -> dict:
  """Nested dict -> {"/"-separated path: leaf}."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for key, sub in tree.items():
    out.update(flatten(sub, f"{prefix}/{key}" if prefix else str(key)))
  return out


class PartsHandler(ocp.CheckpointHandler):
  """The "parts" item: saving moves finished parts in; restoring reads them all."""

  def save(self, directory: epath.Path, args: "PartsSave"):
    if not args.parts:  # distributed mode: process 0 moves every process's parts
      return
    os.makedirs(directory, exist_ok=True)
    for island, path in args.parts.items():
      # A rename on the same file system: the step being committed takes the part as written.
      shutil.move(path, os.path.join(directory, island))

  def restore(self, directory: epath.Path, args: "PartsRestore") -> dict:
    """{path: array} for every array of `args.abstract` ({path: ShapeDtypeStruct}), each read
    straight into its abstract sharding."""
    out = {}
    for part in part_dirs(directory):
      names = _part_metadata(part)
      target = {}
      for name in names:
        insert(target, name, args.abstract[name])
      with ocp.StandardCheckpointer() as reader:
        out.update(flatten(reader.restore(part, target)))
    return out

  def metadata(self, directory: epath.Path) -> dict:
    """{path: (shape, dtype name)} over all parts."""
    out = {}
    for part in part_dirs(directory):
      for name, (shape, dtype) in _part_metadata(part).items():
        if name in out:
          raise ValueError(f"{name} is saved by two parts ({part} and another)")
        out[name] = (shape, dtype)
    return out


def part_dirs(directory) -> list[str]:
  """The island directories of a "parts" item (Orbax puts its own marker files beside them)."""
  paths = [os.path.join(directory, name) for name in sorted(os.listdir(directory))]
  return [p for p in paths if os.path.isdir(p)]


def _part_metadata(part: str) -> dict:
  flat = flatten(ocp.StandardCheckpointHandler().metadata(epath.Path(part)).tree)
  return {name: (tuple(m.shape), jnp.dtype(m.dtype).name) for name, m in flat.items()}


@ocp.args.register_with_handler(PartsHandler, for_save=True)
@dataclasses.dataclass
class PartsSave(ocp.args.CheckpointArgs):
  parts: dict  # island -> directory of its finished part


@ocp.args.register_with_handler(PartsHandler, for_restore=True)
@dataclasses.dataclass
class PartsRestore(ocp.args.CheckpointArgs):
  abstract: dict  # path -> ShapeDtypeStruct with the sharding to restore into
