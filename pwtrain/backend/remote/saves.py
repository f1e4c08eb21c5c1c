"""The controller's side of checkpoints written by the island workers (see checkpoint_parts).

A remote train state is a tree of `RemoteValue`s; `leaf_refs` turns one into a tree of
`LeafRef`s (which worker, which stored value, which of its arrays) without fetching anything,
so the trainer's usual `to_checkpoint` rearranges references into the whole-model tree.
`PendingSave` is phase one of the two-phase commit: it queues a Save on every worker that holds
a leaf, and `wait()` reports when all have written their part (and their fingerprints), or
raises with every worker's error.
"""

import dataclasses
import uuid
from typing import Any

import grpc
import jax

from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote.client import WorkerClient, WorkerLost
from pwtrain.backend.remote.values import rpc_error
from pwtrain.checkpoint import integrity


@dataclasses.dataclass(frozen=True)
class LeafRef:
  """One array of a value stored on a worker."""

  worker: WorkerClient
  handle: str
  index: int
  aval: Any  # ShapeDtypeStruct

  @property
  def shape(self):
    return self.aval.shape

  @property
  def dtype(self):
    return self.aval.dtype


def leaf_refs(value):
  """A RemoteValue's tree with a LeafRef per array (nothing is fetched)."""
  ref = value.ref
  leaves = [LeafRef(ref.worker, ref.handle, i, a) for i, a in enumerate(ref.avals)]
  return jax.tree.unflatten(ref.treedef, leaves)


class SaveFailed(RuntimeError):
  """A worker could not write its part; the step was not committed."""


class PendingSave:
  """Queues, on each worker, a Save of its leaves of `whole` into `directory/<island>` (a
  checkpoint.PartWriter of references to the workers' arrays)."""

  local_arrays = False

  def __init__(self, whole, directory: str):
    self.directory = directory
    self.ticket = uuid.uuid4().hex
    per_worker: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(whole)[0]:
      if not isinstance(leaf, LeafRef):
        raise TypeError(f"{integrity.path_name(path)}: a remote state holds only worker arrays")
      items = per_worker.setdefault(leaf.worker, {})
      item = items.setdefault(leaf.handle, pb.SaveItem(handle=leaf.handle))
      item.leaves.append(leaf.index)
      item.names.append(integrity.path_name(path))
    self.parts = {w.island: f"{directory}/{w.island}" for w in per_worker}
    calls = []
    for worker, items in per_worker.items():
      save = pb.Save(directory=self.parts[worker.island], items=list(items.values()))
      save.ticket = self.ticket
      calls.append((worker, worker.enqueue_async([pb.Op(name="save", save=save)])))
    for worker, call in calls:  # queued before the next step's ops can donate the arrays
      try:
        call.result()
      except grpc.RpcError as e:
        raise WorkerLost(worker.island, f"save not queued: {e.details()}") from None
    self._workers = list(per_worker)

  def wait(self) -> dict:
    """{array path: fingerprint} once every worker has written its part."""
    futures = [(w, w.await_save(self.ticket)) for w in self._workers]
    fingerprints, errors = {}, []
    for worker, future in futures:
      try:
        reply = future.result()
      except grpc.FutureCancelledError:  # by the health monitor: the worker is lost
        raise worker.lost_error() from None
      except grpc.RpcError as e:
        lost = rpc_error(worker, e, frozenset({worker.island}))
        if isinstance(lost, WorkerLost):  # the worker is gone, not only its save
          raise lost from None
        errors.append(f"{worker.address} ({worker.island}): {e.code().name}: {e.details()}")
        continue
      if reply.error:
        errors.append(reply.error)
      fingerprints.update(zip(reply.names, reply.fingerprints, strict=True))
    if errors:
      raise SaveFailed("; ".join(errors))
    return fingerprints
