"""Checkpoints of a distributed run (backend.mode="distributed"): each island's processes
write its part and every process reads a checkpoint on the host.

Orbax's multi-process save and restore take only arrays with data on every process (its
save reads each array's first local shard); an island here lives on one process or spans a few,
so each island's arrays are one part (checkpoint_parts' format, committed by process 0): an
island of one process writes its arrays as host arrays with an Orbax checkpointer of that
process alone, an island spanning processes with an Orbax checkpointer of those processes (each
writes its shards). Any checkpoint, parts or a whole-state item, is read on the host and each
array put onto its island.
"""

import asyncio
import logging
import os
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.serialization import ocdbt_utils, type_handler_registry
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from pwtrain import processes
from pwtrain.checkpoint.integrity import fingerprint, path_name
from pwtrain.checkpoint.parts import insert
from pwtrain.sharding import from_host, stand_in


def _these_processes(owners, name: str) -> ocp.options.MultiprocessingOptions:
  """Orbax's options for a checkpointer of the processes `owners` alone: the lowest is the
  primary, barriers are among them only, under keys prefixed `name`."""
  return ocp.options.MultiprocessingOptions(
    primary_host=min(owners), active_processes=set(owners), barrier_sync_key_prefix=name
  )


def _this_process_only() -> ocp.options.MultiprocessingOptions:
  me = jax.process_index()
  return _these_processes({me}, f"process{me}")


class _ThisProcessNumpy(ocp.type_handlers.NumpyHandler):
  """Orbax's numpy handler, writing from this process. The stock one takes a numpy array to be
  the same on every process and writes it from process 0 only, so another process's part would
  be committed without its data (and Orbax refuses a jax.Array held by one process when there
  are several). The same writes as the stock handler's, without the process-0 condition."""

  async def _background_serialize(self, values, infos, args=None):
    writes = []
    for value, info, arg in zip(values, infos, args, strict=True):
      await info.await_path_creation()
      spec = ts_utils.build_array_write_spec(
        info=info,
        arg=arg,
        global_shape=value.shape,
        local_shape=value.shape,
        dtype=value.dtype,
        use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
        metadata_key=self._metadata_key,
      )
      writes.append(self._open_and_write(value, spec.json, info.ts_context))
    await asyncio.gather(*writes)


def island_checkpointer(owners, name: str) -> ocp.AsyncCheckpointer:
  """An asynchronous Orbax pytree checkpointer of the processes `owners` together (barriers
  among them only), for the jax.Arrays of an island spanning them: `save` copies each process's
  shards to its host and returns, each process then writes its own, the lowest creates the
  arrays and finalises the part (`wait_until_finished`). Its array handler is told that primary
  process: Orbax's own creates an array from process 0, which need not be among `owners`."""
  options = _these_processes(owners, name)
  arrays = ocp.type_handlers.ArrayHandler(primary_host=min(owners))
  registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
  handler = ocp.PyTreeCheckpointHandler(
    multiprocessing_options=options, type_handler_registry=registry
  )
  # Directories made before `save` returns: created asynchronously, Orbax signals their
  # creation under keys that hold no process set, which two islands' saves share (seen hanging).
  synchronous_directories = ocp.options.AsyncOptions(create_directories_asynchronously=False)
  return ocp.AsyncCheckpointer(
    handler, multiprocessing_options=options, async_options=synchronous_directories
  )


class _NoArrayMetadataNotice(logging.Filter):
  """Drops Orbax's warning "No jax.Array in TypeHandlerRegistry: ArrayMetadata persistence is
  disabled", which a checkpointer without a jax.Array handler logs at every save: the process
  checkpointer has none by design (it writes host arrays, which have no such metadata)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "No jax.Array in TypeHandlerRegistry" not in record.getMessage()


_NO_ARRAY_METADATA_NOTICE = _NoArrayMetadataNotice()


def process_checkpointer() -> ocp.Checkpointer:
  """An Orbax pytree checkpointer of this process alone (no barriers with the run's other
  processes), for the numpy parts that one process writes by itself (save with
  `ocp.args.PyTreeSave`)."""
  logging.getLogger("absl").addFilter(_NO_ARRAY_METADATA_NOTICE)  # Orbax logs through absl
  registry = type_handler_registry.create_type_handler_registry((np.ndarray, _ThisProcessNumpy()))
  handler = ocp.PyTreeCheckpointHandler(
    multiprocessing_options=_this_process_only(), type_handler_registry=registry
  )
  return ocp.Checkpointer(handler, multiprocessing_options=_this_process_only())


def read_on_host(directory: str, abstract: dict) -> dict:
  """{path: array} of the Orbax pytree checkpoint (a part, or a whole state item) in
  `directory`, read by this process alone as host arrays and put into `abstract`'s shardings
  ({path: ShapeDtypeStruct}). Distributed mode reads this way: Orbax's multi-process restore
  takes only shardings with devices on every process, and an island here lives on one or a few.
  A part none of whose arrays has a device here is not read: its arrays are stand-ins, as
  every other process's node outputs are."""
  handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=_this_process_only())
  tree = handler.metadata(epath.Path(directory)).tree
  names = [path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if not any(abstract[name].sharding.addressable_devices for name in names):
    return {name: stand_in(abstract[name]) for name in names}  # other processes' island
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  with ocp.Checkpointer(handler, multiprocessing_options=_this_process_only()) as reader:
    values = reader.restore(directory, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  out = {}
  for path, value in jax.tree_util.tree_flatten_with_path(values)[0]:
    name = path_name(path)
    out[name] = from_host(np.asarray(value), abstract[name])
  return out


class ProcessParts:
  """Distributed mode's part writer (Checkpointer's `part_writer`): one part per island (the
  leaves on one set of devices), written by the island's processes: by its one process as host
  arrays with an Orbax checkpointer of its own, or by the processes it spans together
  (`island_checkpointer`); the commit then moves every part into the step.

  Every process writes into the same `pending` directory; `wait()` returns once all have
  written (a barrier), with the whole state's fingerprints, which every process computes alike
  (integrity.fingerprint asks the other processes for theirs). Then `parts` names every part on
  process 0, which commits them, and none elsewhere."""

  local_arrays = True  # parts.PartWriter: saves this process's jax.Arrays

  def __init__(self, state, pending: str):
    me = jax.process_index()
    self.pending = pending
    groups: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      devices = frozenset(leaf.sharding.device_set)
      groups.setdefault(devices, {})[path_name(path)] = leaf
    self.parts, trees, self._islands = {}, [], []
    for n, (devices, leaves) in enumerate(groups.items()):  # in the same order on every process
      owners = frozenset(d.process_index for d in devices)
      if me not in owners:
        continue
      name = f"process{me}-{n}" if len(owners) == 1 else f"processes{min(owners)}-{n}"
      self.parts[name] = path = os.path.join(pending, name)
      tree: dict = {}
      for leaf_name, leaf in leaves.items():
        insert(tree, leaf_name, np.asarray(leaf) if len(owners) == 1 else leaf)
      if len(owners) == 1:
        trees.append((path, tree))
      else:  # its shards reach the host now (a later step may donate them), written meanwhile
        writer = island_checkpointer(owners, f"{os.path.basename(pending)}-{name}")
        writer.save(path, args=ocp.args.PyTreeSave(tree))
        self._islands.append(writer)
    self._fingerprints = fingerprint(state)
    self._writer = threading.Thread(target=self._write, args=(trees,), daemon=True)
    self._error: BaseException | None = None
    self._writer.start()

  def _write(self, trees) -> None:
    try:
      with process_checkpointer() as writer:
        for path, tree in trees:
          writer.save(path, args=ocp.args.PyTreeSave(tree))
    except BaseException as e:  # noqa: BLE001 - raised by wait()
      self._error = e

  def wait(self) -> dict:
    self._writer.join()
    for writer in self._islands:
      writer.wait_until_finished()
      writer.close()
    if self._error is not None:
      raise self._error
    processes.barrier(f"parts/{os.path.basename(self.pending)}")
    self.parts = {}
    if jax.process_index() == 0:
      self.parts = {name: os.path.join(self.pending, name) for name in os.listdir(self.pending)}
    return self._fingerprints
