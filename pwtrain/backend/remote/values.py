"""Values living on island workers, as the controller holds them: a `Ref` names one (which
worker, which handle, what it looks like), a `RemoteValue` is a program output that later
programs read where it is and `.result()` fetches once. A failed call is reported as the loss of
an island (`WorkerLost`) when a worker it depends on is gone, else as the worker's own error.
"""

import dataclasses
import re
import threading
import weakref
from typing import Any

import grpc
import jax

from pwtrain.backend.remote.client import WorkerClient, WorkerLost


@dataclasses.dataclass(frozen=True)
class Ref:
  """A value in a worker's store: its handle and what it looks like on the controller."""

  worker: WorkerClient
  handle: str
  treedef: Any
  avals: tuple
  islands: frozenset = frozenset()  # those of the program that made it (a failure's suspects)


class RemoteValue:
  """A program output living on a worker. Later programs read it where it is; `.result()`
  fetches it once and rebuilds it as (stand-in) jax.Arrays. Dropped on the worker when the
  controller lets go of it."""

  def __init__(self, ref: Ref):
    self.ref = ref
    self._lock = threading.Lock()
    self._value = None
    self._done = False
    weakref.finalize(self, ref.worker.release_later, ref.handle)

  @property
  def island(self) -> str:
    return self.ref.worker.island

  def done(self) -> bool:
    return self._done

  def result(self, timeout=None):
    del timeout  # fetches wait for the computation; a lost worker is reported as WorkerLost
    with self._lock:
      if not self._done:
        self._value = fetch_value(self.ref)
        self._done = True
      return self._value


def fetch_value(ref: Ref):
  """The referenced value fetched now and rebuilt as (stand-in) jax.Arrays; not cached."""
  try:
    leaves = ref.worker.fetch(ref.handle)
  except grpc.RpcError as e:
    raise rpc_error(ref.worker, e, ref.islands) from None
  # Unspecified shardings (a host upload's, say) land on the default device.
  placed = [jax.device_put(x, a.sharding) for x, a in zip(leaves, ref.avals, strict=True)]
  return jax.tree.unflatten(ref.treedef, placed)


def wait_computed(values) -> None:
  """Returns once each RemoteValue among `values` is computed on its worker, its pulls from
  other workers done: a wait-only Fetch each, nothing sent. A value whose own worker is lost
  (before or while it waits) is gone with it and left out: what reads it reports that loss.
  Any other failure raises as `fetch_value`'s does (WorkerLost where the value waited on a pull
  from a lost worker)."""
  for value in values:
    if not isinstance(value, RemoteValue) or value.ref.worker.lost:
      continue
    try:
      value.ref.worker.fetch(value.ref.handle, wait_only=True)
    except WorkerLost:  # a call cancelled as a worker was declared lost
      if not value.ref.worker.lost:
        raise
    except grpc.RpcError as e:
      error = rpc_error(value.ref.worker, e, value.ref.islands)  # finds the lost workers
      if not value.ref.worker.lost:
        raise error from None


# How a worker reports a failed pull from another worker (receives.py).
_FAILED_PULL = re.compile(r"transfer \S+ from (\S+) failed")


def rpc_error(worker: WorkerClient, e: grpc.RpcError, islands=frozenset()) -> Exception:
  """WorkerLost if the worker of `islands` (those the failed call depends on; every island if
  none are named), or the worker a failed transfer pulled from (named in the error: a value
  copied from a worker lost since, which may not be of `islands`), is gone (a failed transfer
  on a live worker may be the symptom), else the worker's own error message."""
  if worker.monitor is not None:
    try:
      for address in _FAILED_PULL.findall(e.details() or ""):
        source = worker.monitor.find(address)
        if source is not None:
          worker.monitor.check_now({source.island})
      worker.monitor.check_now(islands or None)
    except WorkerLost as lost:
      return lost
  if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
    return WorkerLost(worker.island, f"worker {worker.address}: {e.code().name}: {e.details()}")
  return RuntimeError(f"worker {worker.address} ({worker.island}): {e.details()}")
