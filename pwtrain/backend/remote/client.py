"""The controller's side of one island worker: its stub, with the token and deadlines on every
call, and the releases of pinned values waiting to ride on the next Enqueue."""

import logging
import threading

import grpc

from pwtrain.backend.remote import arrays, auth
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import open_channel

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
  """A worker died or stopped answering."""


class WorkerClient:
  def __init__(self, address: str, token: str, *, timeout_s: float = 30.0, tls_ca: str = ""):
    self.address = address
    self.timeout_s = timeout_s  # for calls that return at once (not Fetch, which waits)
    self._metadata = auth.call_metadata(token)
    self._channel = open_channel(address, tls_ca)  # TLS verified against tls_ca when given
    self.stub = pb_grpc.WorkerStub(self._channel)
    self._releases: list[str] = []
    self._lock = threading.Lock()
    self._active: set = set()  # Fetch calls in flight, cancelled if a worker is lost
    self.lost: str | None = None  # set by the health monitor: why this worker is gone
    self.closed = False
    self.monitor: Monitor | None = None  # set by Cluster.connect
    info = self.health(wait_s=timeout_s)
    self.island, self.num_devices, self.platform = info.island, info.num_devices, info.platform

  def health(self, wait_s: float | None = None) -> pb.HealthReply:
    """Health; with `wait_s`, waits that long for a worker that is still starting."""
    return self.stub.Health(
      pb.Empty(),
      metadata=self._metadata,
      timeout=wait_s or self.timeout_s,
      wait_for_ready=wait_s is not None,
    )

  def compile(self, name: str, exported: bytes, mesh, donate, out_leaves, out_shardings) -> None:
    self.stub.Compile(
      pb.CompileRequest(
        name=name,
        exported=exported,
        mesh_axes=list(mesh.axis_names),
        mesh_shape=[int(s) for s in mesh.devices.shape],
        donate=list(donate),
        out_leaves=list(out_leaves),
        out_shardings=[arrays.sharding_to_proto(s) for s in out_shardings or ()],
      ),
      metadata=self._metadata,
      timeout=self.timeout_s,
    )

  def enqueue_async(self, ops: list) -> grpc.Future:
    with self._lock:
      release, self._releases = self._releases, []
    return self.stub.Enqueue.future(
      pb.EnqueueRequest(ops=ops, release=release), metadata=self._metadata, timeout=self.timeout_s
    )

  def put_async(self, handle: str, leaves: list, shardings=None, uses: int = 0) -> grpc.Future:
    chunks = arrays.to_chunks(handle, leaves, shardings, uses)
    return self.stub.Put.future(chunks, metadata=self._metadata, timeout=self.timeout_s)

  def fetch(self, handle: str, release: bool = False) -> list:
    """The value's arrays on the host, once computed (waits as long as that takes, unless the
    cluster's monitor declares a worker lost and cancels the call)."""
    if self.lost:
      raise WorkerLost(self.lost)
    call = self.stub.Fetch(pb.FetchRequest(handle=handle, release=release), metadata=self._metadata)
    with self._lock:
      self._active.add(call)
    try:
      _, received = arrays.from_chunks(call)
    except grpc.RpcError:
      if self.lost:
        raise WorkerLost(self.lost) from None
      raise
    finally:
      with self._lock:
        self._active.discard(call)
    return [x for x, _ in received]

  def await_save(self, ticket: str) -> grpc.Future:
    """A future of the SaveReply of a queued Save (cancelled if the worker is lost)."""
    if self.lost:
      raise WorkerLost(self.lost)
    call = self.stub.AwaitSave.future(pb.AwaitSaveRequest(ticket=ticket), metadata=self._metadata)
    with self._lock:
      self._active.add(call)
    call.add_done_callback(self._forget)
    return call

  def _forget(self, call) -> None:
    with self._lock:
      self._active.discard(call)

  def declare_lost(self, reason: str) -> None:
    """Marks the cluster unusable from this worker's side and cancels the calls waiting on it."""
    self.lost = reason
    with self._lock:
      active = list(self._active)
    for call in active:
      call.cancel()

  def release_later(self, handle: str) -> None:
    """Drops a pinned value after the ops already enqueued (sent with the next Enqueue)."""
    with self._lock:
      self._releases.append(handle)

  def flush_releases(self) -> None:
    with self._lock:
      release, self._releases = self._releases, []
    if release:
      self.stub.Release(
        pb.ReleaseRequest(handles=release), metadata=self._metadata, timeout=self.timeout_s
      )

  def timeline(self) -> pb.TimelineReply:
    return self.stub.Timeline(pb.Empty(), metadata=self._metadata, timeout=self.timeout_s)

  def reset(self) -> None:
    self.stub.Reset(pb.Empty(), metadata=self._metadata, timeout=self.timeout_s)

  def shutdown(self) -> None:
    self.stub.Shutdown(pb.Empty(), metadata=self._metadata, timeout=self.timeout_s)

  def close(self) -> None:
    self.closed = True
    self._channel.close()


class Monitor:
  """Pings every worker of a cluster each `period_s`; a worker that misses `misses` pings in a
  row (dead, hung, unreachable) is lost: every client of the cluster then refuses to fetch and
  cancels what it is waiting for, since a step that needs the lost island cannot finish."""

  def __init__(self, clients: list[WorkerClient], period_s: float, misses: int = 3):
    self.clients, self.period_s, self.misses = clients, period_s, misses
    self._stop = threading.Event()
    threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

  def _loop(self):
    missed = [0] * len(self.clients)
    while not self._stop.wait(self.period_s):
      if all(c.closed for c in self.clients) or any(c.lost for c in self.clients):
        return
      for i, client in enumerate(self.clients):
        try:
          client.stub.Health(pb.Empty(), metadata=client._metadata, timeout=self.period_s)
          missed[i] = 0
        except grpc.RpcError as e:
          missed[i] += 1
          if missed[i] >= self.misses or e.code() == grpc.StatusCode.UNAVAILABLE:
            self.declare(client, f"{e.code().name} after {missed[i]} missed heartbeat(s)")
            return

  def declare(self, client: WorkerClient, why: str) -> None:
    reason = f"worker {client.address} (island {client.island}) is lost: {why}"
    log.error("%s", reason)
    for c in self.clients:
      c.declare_lost(reason)

  def check_now(self) -> None:
    """One ping of every worker (after an error whose cause may be a lost worker)."""
    for client in self.clients:
      if client.lost:
        raise WorkerLost(client.lost)
      try:
        client.stub.Health(pb.Empty(), metadata=client._metadata, timeout=self.period_s)
      except grpc.RpcError as e:
        self.declare(client, f"{e.code().name}: {e.details()}")
        raise WorkerLost(client.lost) from None

  def stop(self):
    self._stop.set()
