"""The controller's side of one island worker: its stub, with the token and deadlines on every
call, and the releases of pinned values waiting to ride on the next Enqueue."""

import logging
import threading

import grpc

from pwtrain.backend.faults import IslandLost
from pwtrain.backend.remote import arrays, auth
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import open_channel

log = logging.getLogger(__name__)


class WorkerLost(IslandLost):
  """An island's worker died or stopped answering: the island is lost (`cause` says how)."""


class WorkerClient:
  def __init__(self, address: str, token: str, *, timeout_s: float = 30.0, tls_ca: str = ""):
    self.address = address
    self.timeout_s = timeout_s  # for calls that return at once (not Fetch, which waits)
    self._metadata = auth.call_metadata(token)
    self._tls_ca = tls_ca
    self._channel = open_channel(address, tls_ca)  # TLS verified against tls_ca when given
    self.stub = pb_grpc.WorkerStub(self._channel)
    self._releases: list[str] = []
    self._compiled: list = []  # every CompileRequest sent, in order
    self._lock = threading.Lock()
    self._active: set = set()  # Fetch calls in flight, cancelled if a worker is lost
    self.lost: str | None = None  # set by the health monitor: why this worker is gone
    self.answering = False  # set by the health monitor: a lost worker answers again
    self._lost_island: str | None = None  # the island whose loss made this client unusable
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
    """Has the worker compile `exported` as `name` (kept, to compile it again on a worker that
    comes back: `rejoin`)."""
    request = pb.CompileRequest(
      name=name,
      exported=exported,
      mesh_axes=list(mesh.axis_names),
      mesh_shape=[int(s) for s in mesh.devices.shape],
      donate=list(donate),
      out_leaves=list(out_leaves),
      out_shardings=[arrays.sharding_to_proto(s) for s in out_shardings or ()],
    )
    self.stub.Compile(request, metadata=self._metadata, timeout=self.timeout_s)
    self._compiled.append(request)

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
      raise self.lost_error()
    call = self.stub.Fetch(pb.FetchRequest(handle=handle, release=release), metadata=self._metadata)
    with self._lock:
      self._active.add(call)
    try:
      _, received = arrays.from_chunks(call)
    except grpc.RpcError:
      if self.lost:
        raise self.lost_error() from None
      raise
    finally:
      with self._lock:
        self._active.discard(call)
    return [x for x, _ in received]

  def await_save(self, ticket: str) -> grpc.Future:
    """A future of the SaveReply of a queued Save (cancelled if the worker is lost)."""
    if self.lost:
      raise self.lost_error()
    call = self.stub.AwaitSave.future(pb.AwaitSaveRequest(ticket=ticket), metadata=self._metadata)
    with self._lock:
      self._active.add(call)
    call.add_done_callback(self._forget)
    return call

  def _forget(self, call) -> None:
    with self._lock:
      self._active.discard(call)

  def lost_error(self) -> WorkerLost:
    return WorkerLost(self._lost_island or self.island, self.lost or "its worker is lost")

  def declare_lost(self, reason: str, island: str | None = None) -> None:
    """Marks this worker's island lost (`reason`), or the cluster unusable from its side because
    `island` is, and cancels the calls waiting on it."""
    self.lost = reason
    self._lost_island = island
    self.answering = False
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

  def probe(self, timeout_s: float) -> bool:
    """Whether the worker answers a Health call now, on a fresh channel (a lost worker's
    channel may be backing off between reconnects)."""
    channel = open_channel(self.address, self._tls_ca)
    try:
      pb_grpc.WorkerStub(channel).Health(pb.Empty(), metadata=self._metadata, timeout=timeout_s)
      return True
    except grpc.RpcError:
      return False
    finally:
      channel.close()

  def rejoin(self) -> None:
    """A lost worker answers again (relaunched, or restarted by someone else): reconnected,
    reset (a worker that only went silent drops what it held) and given every executable
    compiled for it before, under the same names, so that every program built for its island
    runs there again. Its stored values are gone: what it needs is copied onto it."""
    self._reconnect()
    self.reset()
    for request in self._compiled:
      self.stub.Compile(request, metadata=self._metadata, timeout=self.timeout_s)
    log.warning(
      "worker %s (island %s) rejoined: %d executables compiled again",
      self.address,
      self.island,
      len(self._compiled),
    )

  def _reconnect(self) -> None:
    old = self._channel
    self._channel = open_channel(self.address, self._tls_ca)
    self.stub = pb_grpc.WorkerStub(self._channel)
    old.close()
    with self._lock:
      self._releases = []  # handles of the lost worker's store
    self.lost = self._lost_island = None
    self.answering = False

  def shutdown(self) -> None:
    self.stub.Shutdown(pb.Empty(), metadata=self._metadata, timeout=self.timeout_s)

  def close(self) -> None:
    self.closed = True
    self._channel.close()


PING_DEADLINE_S = 2.0  # the least time a heartbeat's ping waits for its answer (Monitor)


class Monitor:
  """Pings every worker of a cluster each `period_s`; a worker that misses `misses` pings in a
  row (hung, unreachable: each waited for up to `PING_DEADLINE_S` or the period, whichever is
  longer, so that a live worker slow to answer on a loaded machine is not taken for dead), or
  whose ping finds nobody listening (dead: UNAVAILABLE at once), is lost.

  With `isolate` (elastic pods: the controller carries on without a lost island), only that
  worker is lost, and the monitor goes on pinging it: once it answers again (relaunched, or
  restarted by someone else) its `answering` is set. Otherwise every client of the cluster is
  lost with it, refusing to fetch and cancelling what it waits for, since a step that needs the
  lost island cannot finish (and the supervisor restarts them all)."""

  def __init__(
    self, clients: list[WorkerClient], period_s: float, misses: int = 3, isolate: bool = False
  ):
    self.clients, self.period_s, self.misses, self.isolate = clients, period_s, misses, isolate
    self.deadline_s = max(period_s, PING_DEADLINE_S)  # how long each ping waits for its answer
    self._stop = threading.Event()
    threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

  def _loop(self):
    missed = [0] * len(self.clients)
    while not self._stop.wait(self.period_s):
      if all(c.closed for c in self.clients):
        return
      if not self.isolate and any(c.lost for c in self.clients):
        return
      for i, client in enumerate(self.clients):
        if client.closed:
          continue
        if client.lost:
          if not client.answering and client.probe(self.deadline_s):
            log.warning("worker %s (island %s) answers again", client.address, client.island)
            client.answering = True
          continue
        try:
          client.stub.Health(pb.Empty(), metadata=client._metadata, timeout=self.deadline_s)
          missed[i] = 0
        except grpc.RpcError as e:
          missed[i] += 1
          if missed[i] >= self.misses or e.code() == grpc.StatusCode.UNAVAILABLE:
            self.declare(client, f"{e.code().name} after {missed[i]} missed heartbeat(s)")
            missed[i] = 0
            if not self.isolate:
              return

  def declare(self, client: WorkerClient, why: str) -> None:
    if client.lost:
      return
    reason = f"worker {client.address} {why}"
    log.error("island %s lost: %s", client.island, reason)
    for c in [client] if self.isolate else self.clients:
      c.declare_lost(reason, client.island)

  def check_now(self, islands=None) -> None:
    """One ping of the workers of `islands` (all by default) after an error whose cause may be
    a lost worker; raises WorkerLost for the first lost one."""
    for client in self.clients:
      if islands is not None and client.island not in islands:
        continue
      if client.lost:
        raise client.lost_error()
      try:
        client.stub.Health(pb.Empty(), metadata=client._metadata, timeout=self.deadline_s)
      except grpc.RpcError as e:
        self.declare(client, f"{e.code().name}: {(e.details() or '').split(';')[0]}")
        raise client.lost_error() from None

  def stop(self):
    self._stop.set()
