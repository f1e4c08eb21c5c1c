"""The controller's side of one island worker: its stub, with the token and deadlines on every
call, and the releases of pinned values waiting to ride on the next Enqueue."""

import logging
import threading
import time

import grpc

from pwtrain.backend.faults import IslandLost
from pwtrain.backend.remote import arrays, auth, launcher
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import open_channel
from pwtrain.errors import ConfigError

log = logging.getLogger(__name__)


class WorkerLost(IslandLost):
  """An island's worker died or stopped answering: the island is lost (`cause` says how)."""


def refusal(e: grpc.RpcError) -> str | None:
  """Why a worker refuses this controller (a wrong token, a TLS handshake that fails), if the
  failed call says so: a setting to fix, not a worker still starting."""
  details = e.details() or ""
  if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
    return (
      f"it refuses the token ({details}): give the workers' token in backend.token_file or "
      "the variable backend.token_env names"
    )
  if "handshake" in details.lower():
    return (
      f"the TLS handshake fails ({details.split('last error: ')[-1]}): backend.tls_ca must verify "
      "the worker's certificate, and a worker serving TLS needs backend.tls_ca"
    )
  return None


class WorkerClient:
  def __init__(
    self,
    address: str,
    token: str,
    *,
    timeout_s: float = 30.0,
    tls_ca: str = "",
    wait: bool = True,
  ):
    """Connects to the worker at `address`, waiting up to `timeout_s` for one still starting
    (`wait`; else a worker not up fails at once, UNAVAILABLE). A worker that refuses the token
    or the TLS handshake is a ConfigError, at once."""
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
    try:
      info = self.health(wait_s=timeout_s if wait else None)
    except grpc.RpcError as e:
      why = refusal(e)
      if why is None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        why = self._refused_now()  # waiting hides a failed handshake behind the deadline
      if why is None:
        raise
      self._channel.close()
      raise ConfigError(f"worker {address}: {why}") from None
    self.island, self.num_devices, self.platform = info.island, info.num_devices, info.platform
    self.incarnation = info.incarnation  # the worker process this client serves (Monitor)
    self.answered_at = time.monotonic()  # its last answer to a ping (Monitor)

  def _refused_now(self) -> str | None:
    try:
      self.health()
    except grpc.RpcError as e:
      return refusal(e)
    return None

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

  def enqueue_async(self, ops: list, priority=False, program=0, pulled=None) -> grpc.Future:
    """A future of the Enqueue of `ops` of controller program `program` (cancelled if the worker
    is lost: FutureCancelledError); `priority`: placed ahead of the queued work the worker has
    not begun; `pulled` (a list): an Offer instead, answering the latest program they may
    follow (the worker's ordered.py)."""
    with self._lock:
      release, self._releases = self._releases, []
    request = pb.EnqueueRequest(
      ops=ops, release=release, priority=priority, program=program, pulled=pulled or ()
    )
    call = self.stub.Enqueue if pulled is None else self.stub.Offer
    return self._watched(call.future(request, metadata=self._metadata, timeout=self.timeout_s))

  def place_async(self, after: int) -> grpc.Future:
    """A future of the Place of the offered operations after program `after`."""
    request = pb.PlaceRequest(after=after)
    return self._watched(
      self.stub.Place.future(request, metadata=self._metadata, timeout=self.timeout_s)
    )

  def put_async(self, handle: str, leaves: list, shardings=None, uses: int = 0) -> grpc.Future:
    """A future of the Put (cancelled if the worker is lost: FutureCancelledError)."""
    chunks = arrays.to_chunks(handle, leaves, shardings, uses)
    return self._watched(
      self.stub.Put.future(chunks, metadata=self._metadata, timeout=self.timeout_s)
    )

  def _watched(self, call: grpc.Future) -> grpc.Future:
    """`call`, cancelled if this worker is declared lost before it ends."""
    with self._lock:
      self._active.add(call)
    call.add_done_callback(self._forget)
    if self.lost:
      call.cancel()
    return call

  def fetch(self, handle: str, release: bool = False, wait_only: bool = False) -> list:
    """The value's arrays on the host, once computed (waits as long as that takes, unless the
    cluster's monitor declares a worker lost and cancels the call); `wait_only`: [] once it is
    computed (nothing is sent, and the value is neither read nor released)."""
    if self.lost:
      raise self.lost_error()
    request = pb.FetchRequest(handle=handle, release=release, wait_only=wait_only)
    call = self.stub.Fetch(request, metadata=self._metadata)
    with self._lock:
      self._active.add(call)
    try:
      received = list(call) if wait_only else arrays.from_chunks(call)[1]  # wait_only: empty
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
    return self._watched(
      self.stub.AwaitSave.future(pb.AwaitSaveRequest(ticket=ticket), metadata=self._metadata)
    )

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

  def abandon(self, source: str, timeout_s: float) -> None:
    """Has this worker fail its pulls from the worker at `source` (declared lost)."""
    self.stub.Abandon(pb.AbandonRequest(source=source), metadata=self._metadata, timeout=timeout_s)

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
    self.incarnation = self.health().incarnation  # before it is live again (Monitor)
    self.answered_at = time.monotonic()
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
  """Pings every worker of a cluster each `period_s`, and declares lost a worker that
  - misses `misses` pings in a row (hung, stopped, unreachable: each waited for up to
    `PING_DEADLINE_S` or the period, whichever is longer, so that a live worker slow to answer
    on a loaded machine is not taken for dead): within `misses` x (period + deadline) of its
    last answer;
  - or whose ping finds nobody listening (dead: UNAVAILABLE at once), or another process on its
    address (its `incarnation` changed: it died and was started again between two pings);
  - or whose execution queue has run one op for more than `progress_timeout_s` (wedged: its
    server answers, its computations never end; 0 never declares it).

  Declaring a worker lost ends every wait on it: the controller's calls to it are cancelled,
  the other workers abandon their pulls from it (Abandon: the ops that read them fail, and so
  do the controller's fetches of those, as that loss: values.rpc_error), and a worker process
  this process launched is killed (SIGKILL), so that a stopped or wedged one is replaced as a
  dead one is (the supervisor starts it again, backend/remote/supervisor.py).

  With `isolate` (elastic pods: the controller carries on without a lost island), only that
  worker is lost, and the monitor goes on pinging it: once it answers again (relaunched, or
  restarted by someone else) its `answering` is set. Otherwise every client of the cluster is
  lost with it, refusing to fetch and cancelling what it waits for, since a step that needs the
  lost island cannot finish (and the supervisor restarts them all)."""

  def __init__(
    self,
    clients: list[WorkerClient],
    period_s: float,
    misses: int = 3,
    isolate: bool = False,
    progress_timeout_s: float = 0.0,
  ):
    self.clients, self.period_s, self.misses, self.isolate = clients, period_s, misses, isolate
    self.progress_timeout_s = progress_timeout_s
    self.deadline_s = max(period_s, PING_DEADLINE_S)  # how long each ping waits for its answer
    self._stop = threading.Event()
    threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

  @property
  def bound_s(self) -> float:
    """The longest a silent worker stays undeclared after its last answer."""
    return self.misses * (self.period_s + self.deadline_s)

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
          reply = client.stub.Health(pb.Empty(), metadata=client._metadata, timeout=self.deadline_s)
          missed[i] = 0
          why = self._unwell(client, reply)
          if why is None:
            client.answered_at = time.monotonic()
        except grpc.RpcError as e:
          missed[i] += 1
          why = None
          if missed[i] >= self.misses or e.code() == grpc.StatusCode.UNAVAILABLE:
            why = f"{e.code().name} after {missed[i]} missed heartbeat(s)"
            missed[i] = 0
        if why is not None:
          self.declare(client, why)
          if not self.isolate:
            return

  def _unwell(self, client: WorkerClient, reply: pb.HealthReply) -> str | None:
    """Why a worker that answered is lost all the same, if it is."""
    if reply.incarnation != client.incarnation:
      return "was started again (a new process answers on its address)"
    if self.progress_timeout_s and reply.running_s > self.progress_timeout_s:
      return (
        f"is wedged: one op has run for {reply.running_s:.0f} s "
        f"(fault.progress_timeout_s={self.progress_timeout_s:g})"
      )
    return None

  def declare(self, client: WorkerClient, why: str) -> None:
    if client.lost:
      return
    reason = f"worker {client.address} {why}"
    log.error("island %s lost: %s", client.island, reason)
    for c in [client] if self.isolate else self.clients:
      c.declare_lost(reason, client.island)
    for other in self.clients:  # their pulls from it would wait for as long as it is silent
      if other is not client and not other.closed:
        try:
          other.abandon(client.address, self.deadline_s)
        except grpc.RpcError:
          pass  # lost too, or soon found so
    # Stopped or wedged, it is replaced as a dead one is; not a process started in its place
    # since it last answered (the supervisor relaunches a dead one at once).
    if launcher.kill_at(client.address, started_before=client.answered_at):
      log.warning("killed worker %s (island %s): it was lost", client.address, client.island)

  def check_now(self, islands=None) -> None:
    """One ping of the workers of `islands` (all by default) after an error whose cause may be
    a lost worker; raises WorkerLost for the first lost one."""
    for client in self.clients:
      if islands is not None and client.island not in islands:
        continue
      if client.lost:
        raise client.lost_error()
      try:
        reply = client.stub.Health(pb.Empty(), metadata=client._metadata, timeout=self.deadline_s)
      except grpc.RpcError as e:
        self.declare(client, f"{e.code().name}: {(e.details() or '').split(';')[0]}")
        raise client.lost_error() from None
      why = self._unwell(client, reply)
      if why is not None:
        self.declare(client, why)
        raise client.lost_error()

  def find(self, address: str) -> WorkerClient | None:
    """The client of the worker at `address`, if it is one of this cluster's."""
    return next((c for c in self.clients if c.address == address), None)

  def stop(self):
    self._stop.set()
