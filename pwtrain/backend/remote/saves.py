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
    self._workers, lost = [], None
    for worker, call in calls:  # queued before the next step's ops can donate the arrays
      try:
        call.result()
        self._workers.append(worker)
      except grpc.FutureCancelledError:  # by the health monitor: the worker is lost
        lost = lost or worker.lost_error()
      except grpc.RpcError as e:
        lost = lost or WorkerLost(worker.island, f"save not queued: {e.details()}")
    if lost is not None:  # the saves queued elsewhere end before their directory is removed
      self._outcomes()
      raise lost

  def wait(self) -> dict:
    """{array path: fingerprint} once every worker has written its part. A worker lost on the
    way is raised (WorkerLost) only once every other worker has ended its own part: the caller
    then removes the pending directory, which no save may still be writing into (an Orbax save
    whose directory is removed under it warns "Metadata file does not exist")."""
    replies, errors, lost = self._outcomes()
    if lost is not None:
      raise lost
    if errors:
      raise SaveFailed("; ".join(errors))
    fingerprints = {}
    for reply in replies:
      fingerprints.update(zip(reply.names, reply.fingerprints, strict=True))
    return fingerprints

  def _outcomes(self) -> tuple[list, list[str], WorkerLost | None]:
    """(the SaveReplies of the workers whose part is written, the errors of those that failed
    writing it, the first loss of a worker), once every queued save has ended."""
    futures, replies, errors, lost = [], [], [], None
    for worker in self._workers:
      try:
        futures.append((worker, worker.await_save(self.ticket)))
      except WorkerLost as e:  # already known to be lost
        lost = lost or e
    for worker, future in futures:
      try:
        reply = future.result()
      except grpc.FutureCancelledError:  # by the health monitor: the worker is lost
        lost = lost or worker.lost_error()
        continue
      except grpc.RpcError as e:
        error = rpc_error(worker, e, frozenset({worker.island}))
        if isinstance(error, WorkerLost):  # the worker is gone, not only its save
          lost = lost or error
        else:
          errors.append(f"{worker.address} ({worker.island}): {e.code().name}: {e.details()}")
        continue
      if reply.error:
        errors.append(reply.error)
      replies.append(reply)
    return replies, errors, lost
