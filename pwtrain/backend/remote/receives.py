"""An island worker's transfers (server.py): each Receive op pulls its value from the worker
that holds it (worker to worker, never through the controller), or reads it from this worker's
store, and places it on this island. Transfers run beside the execution queue, on a pool of at
most `THREADS` threads; the rest wait in arrival order. That cannot deadlock: ops arrive in each
program's order, so the oldest waiting transfer's value depends only on ops sent before it,
which run or fail whatever waits behind it.

A pull waits as long as its value takes to compute, unless its source is abandoned: once the
controller has declared the source's worker lost (client.Monitor) it calls Abandon here, and
every pull from that address enqueued before then fails at once, naming its source (a silent
worker, stopped or wedged, answers nothing and closes nothing, so its streams never end by
themselves). The failure reads "transfer <op> from <address> failed: ...": the controller
reports it as that worker's loss (values.rpc_error).

Test-only: the environment variable PWTRAIN_TEST_PULL_DELAY=`<island>:<seconds>` (TEST_DELAY_ENV)
makes the worker of that island wait that long before each pull from another worker, so that a
pull is still pending once the other workers' values are there (tests/test_silent_faults.py).
Unset, as in every run, pulls start at once.
"""

import concurrent.futures
import dataclasses
import os
import threading
import time

import grpc
import jax

from pwtrain.backend.remote import arrays, auth
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import channel_options

THREADS = 16  # transfers in flight at once per worker
TEST_DELAY_ENV = "PWTRAIN_TEST_PULL_DELAY"  # test-only (the module doc)


@dataclasses.dataclass(eq=False)
class _Pull:
  """A pull from `source` enqueued and not finished: `call` once its stream is open."""

  source: str
  abandoned: bool = False
  call: object = None


class Receives:
  """The transfers of one worker: `submit` at Enqueue, `abandon` when a source is lost."""

  def __init__(self, worker):
    self._worker = worker  # its store, devices, island, token and span recorder
    self._pool = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="receive")
    self._pulls: set[_Pull] = set()
    self._lock = threading.Lock()
    self._peers: dict[str, pb_grpc.WorkerStub] = {}
    island, _, seconds = os.environ.get(TEST_DELAY_ENV, "").partition(":")
    self._test_delay_s = float(seconds) if island == worker.island else 0.0  # the module doc

  def submit(self, op, out: concurrent.futures.Future) -> None:
    """Queues the Receive `op`, whose value goes to `out` (or its failure)."""
    pull = None
    if op.receive.source:
      pull = _Pull(op.receive.source)
      with self._lock:  # registered now, so an Abandon that follows this Enqueue finds it
        self._pulls.add(pull)
    self._pool.submit(self._receive, op, out, pull)

  def abandon(self, source: str) -> int:
    """Fails every pull from `source` enqueued so far (those waiting to start and those
    streaming); how many."""
    with self._lock:
      pulls = [p for p in self._pulls if p.source == source]
      for pull in pulls:
        pull.abandoned = True
      calls = [p.call for p in pulls if p.call is not None]
    for call in calls:
      call.cancel()
    return len(pulls)

  def _receive(self, op, out, pull: _Pull | None) -> None:
    w, r = self._worker, op.receive
    start = time.time()
    try:
      if pull is not None:
        leaves = self._pull(pull, r.handle)
      else:
        leaves = w.store.lookup(r.handle).result()
        w.store.read(r.handle)
      if len(r.shardings) != len(leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(r.shardings)} shardings")
      placed = [
        jax.device_put(x, arrays.sharding_from_proto(s, w.devices))
        for x, s in zip(leaves, r.shardings, strict=True)
      ]
      if op.trace_id:
        jax.block_until_ready(placed)
      out.set_result(placed)
      w.record(op, start)
    except BaseException as e:  # noqa: BLE001 - forwarded to whoever reads the output
      source = f" from {r.source}" if r.source else ""
      why = f"{r.source} was declared lost" if pull and pull.abandoned else describe(e)
      out.set_exception(RuntimeError(f"{w.island}: transfer {op.name}{source} failed: {why}"))
    finally:
      if pull is not None:
        with self._lock:
          self._pulls.discard(pull)

  def _pull(self, pull: _Pull, handle: str) -> list:
    """The arrays of `handle`, fetched from the worker at `pull.source`. A channel whose
    connection was refused waits out a backoff before it connects again, and refuses calls
    meanwhile; so a peer started again on the same address (a pod rejoining: elastic pods) would
    be refused for seconds after it answers. A refused pull therefore gets a new channel and one
    more try."""
    time.sleep(self._test_delay_s)  # 0 but in a test (the module doc)
    for attempt in range(2):
      with self._lock:
        if pull.abandoned:
          raise RuntimeError("abandoned")
        pull.call = self._peer(pull.source, fresh=attempt > 0).Fetch(
          pb.FetchRequest(handle=handle), metadata=auth.call_metadata(self._worker.token)
        )
      try:
        _, received = arrays.from_chunks(pull.call)
        return [x for x, _ in received]
      except grpc.RpcError as e:
        if attempt or pull.abandoned or e.code() != grpc.StatusCode.UNAVAILABLE:
          raise
    raise AssertionError("unreachable")

  def _peer(self, address: str, fresh: bool = False) -> pb_grpc.WorkerStub:
    """The stub of the worker at `address`, its channel kept for later pulls (`fresh`: a new
    channel in place of the kept one). Each channel has its own connection (subchannel) rather
    than one shared by every channel to the address, so a new one connects at once. Called
    with the lock held."""
    if fresh or address not in self._peers:
      options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
      self._peers[address] = pb_grpc.WorkerStub(grpc.insecure_channel(address, options=options))
    return self._peers[address]


def describe(e: BaseException) -> str:
  if isinstance(e, grpc.RpcError):
    return f"{e.code().name}: {e.details()}"
  return f"{type(e).__name__}: {e}"
