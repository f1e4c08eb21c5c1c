"""Transfers between processes by pull (distributed mode): the sending process offers a value
under a number, the receiving process pulls it by that number, each when its own schedule gets
there (`jax.experimental.transfer`: a transfer server per process, on JAX's runtime).

A cross-host `jax.device_put` pairs its two sides by how many such calls each process has made,
so every process must issue them in one order from one queue, and a receive waiting for its
sender holds back every transfer behind it (a 1F1B pipeline's sends and receives alternate).
An offer and a pull block nothing: the offer returns at once (the server sends the value once it
is computed and asked for), and the pull returns at once with an array that becomes ready when
the data has arrived, which the receiving island's next computation can already take.

Used for a transfer of a node's output between two islands of one process each, on different
processes, with the same layout on both sides, whose value no node of the program donates and
the program does not carry into the next (a donated buffer is gone before the peer may have
pulled it: the pull would fail). Every other transfer between processes goes by device_put.
"""

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding

from pwtrain import console, processes
from pwtrain.backend.program import Node, Program, Transfer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pull:
  """One transfer by pull: from `source` to `destination` (process indices), of `spec` (a tree
  of ShapeDtypeStructs with the destination's shardings; `offered`: the same with the source's);
  `number` is its place among the program's transfers, which with the controller and the step
  names it on both sides."""

  source: int
  destination: int
  spec: Any
  offered: Any
  number: int

  def uuid(self, controller: int, step: int) -> int:
    assert self.number < 1 << 16 and step < 1 << 32 and controller < 1 << 14
    return (controller << 48) | (step << 16) | self.number


def pulls(program: Program, islands) -> dict[str, Pull]:
  """{transfer name: Pull} for `program`'s transfers that go by pull (the module's rule); the
  same on every process."""
  owners = {i.name: i.processes for i in islands}
  nodes = {n.name: n for n in program.nodes if isinstance(n, Node)}
  gone = {n.args[i] for n in nodes.values() for i in n.executable.donate_argnums}
  gone |= {program.outputs[k] for k in program.carried}
  out = {}
  transfers = [n for n in program.nodes if isinstance(n, Transfer)]
  for number, t in enumerate(transfers):
    if isinstance(t.src, str) or t.src in gone or t.src[0] not in nodes:
      continue
    source = nodes[t.src[0]]
    a, b = owners[source.island], owners[t.island]
    if len(a) != 1 or len(b) != 1 or a == b:
      continue
    info = source.executable.compiled.out_info
    info = info[t.src[1]] if isinstance(info, tuple) else info
    to = t.sharding
    if isinstance(to, jax.sharding.Sharding):
      to = jax.tree.map(lambda _, s=to: s, info)
    pairs = list(zip(jax.tree.leaves(info), jax.tree.leaves(to), strict=True))
    if not all(_same_layout(i.sharding, s) for i, s in pairs):
      continue
    spec = jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s), info, to)
    out[t.name] = Pull(min(a), min(b), spec, info, number)
  return out


def _same_layout(a, b) -> bool:
  """Whether shardings `a` and `b` (on other devices) cut an array alike: the k-th device of
  each holds the same piece, which is how an offer's shards meet a pull's."""
  if isinstance(a, SingleDeviceSharding) and isinstance(b, SingleDeviceSharding):
    return True
  return (
    isinstance(a, NamedSharding)
    and isinstance(b, NamedSharding)
    and a.mesh.axis_names == b.mesh.axis_names
    and a.mesh.devices.shape == b.mesh.devices.shape
    and a.spec == b.spec
  )


@dataclasses.dataclass(frozen=True)
class PullDeadlines:
  """When a pull from another process is given up (`Puller`): after `timeout_s`, or once
  `peer_lost(process)` names a reason its peer is lost (its liveness: pwtrain/liveness.py);
  `recoverable`: a lost peer's pulls fail, for the caller to recover (elastic pods), rather
  than end this process."""

  timeout_s: float = 600.0
  peer_lost: Callable[[int], str | None] | None = None
  recoverable: bool = False


class Puller:
  """This process's transfer server, and its connections to the other processes' (made on first
  use). `name` names the controller's servers alike on every process: their addresses are
  shared through the coordination service's key-value store."""

  def __init__(
    self,
    name: str,
    timeout_s: float = 600.0,
    on_timeout=None,
    peer_lost: Callable[[int], str | None] | None = None,
    recoverable: bool = False,
  ):
    """`timeout_s`: how long a pulled value may take to arrive before its peer is taken for
    dead or silent; then `on_timeout(message)` (default: log the message and end this process,
    so that the run's supervisor restarts it: everything after the pull would wait forever).
    `peer_lost(process)`: why a peer is taken for lost (its liveness, pwtrain/liveness.py), or
    None; asked about each process a pull waits on, every half second. A lost peer's pulls
    fail at once, as a dead peer's do when its sockets close, where the caller recovers from
    that (`recoverable`: elastic pods drop its pod); else `on_timeout(why)` ends this process
    as a late pull does."""
    from jax.experimental import transfer

    host = _host()
    device = jax.local_devices()[0]
    self._server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
    self._name = name
    self._connections: dict[int, Any] = {}
    self._lock = threading.Lock()  # islands of one process pull from their own threads
    # A process started in a dead one's place replaces its predecessor's address.
    processes.share(f"{name}/{jax.process_index()}", self._server.address(), replace=True)
    on_timeout = on_timeout or _stop_process
    on_lost = self._fail if recoverable else (lambda process, why: on_timeout(why))
    self._watchdog = _Watchdog(timeout_s, on_timeout, peer_lost, on_lost)

  def offer(self, uuid: int, value) -> None:
    """Offers `value` (computed or not) to the process that will pull `uuid`; returns at once."""
    self._server.await_pull(uuid, value)

  def offer_error(self, uuid: int, offered, message: str) -> None:
    """Offers arrays of `offered` (ShapeDtypeStructs on this process's devices) that carry
    `message` as an error: the value could not be computed, and the pull fails with it rather
    than wait for data that never comes."""
    from jax.experimental import transfer

    self.offer(uuid, jax.tree.map(lambda a: transfer.make_error_array(a, message), offered))

  def forget(self, process: int) -> None:
    """Drops the connection to `process`'s server: it was started again (elastic pods), and the
    next pull connects to its new server."""
    with self._lock:
      self._connections.pop(process, None)

  def _fail(self, process: int, why: str) -> None:
    """Fails every pull waiting on `process` (lost: `why`) at once, as its death would, and
    drops the connection: a pull from a process started in its place connects anew."""
    log.warning("%s: the pulls from it fail", why)
    with self._lock:
      connection = self._connections.pop(process, None)
    if connection is not None:
      connection._poison_connection()  # its pending pulls fail; the only way to end them

  def pull(self, process: int, uuid: int, spec):
    """The value `process` offers as `uuid`, as arrays of `spec` that are ready once it has
    arrived; returns at once."""
    with self._lock:
      connection = self._connections.get(process)
      if connection is None:
        address = str(processes.ask(f"{self._name}/{process}"))
        connection = self._connections[process] = self._server.connect(address)
    value = connection.pull(uuid, spec)
    self._watchdog.watch(value, process, f"a transfer from process {process} (pull {uuid})")
    return value


class _Watchdog:
  """Waits beside the islands for pulled values to arrive; one that has not after `timeout_s`
  means its peer is dead or silent: `on_timeout` is told, naming the peer. Every half second it
  asks `peer_lost` about each process a pull waits on; a lost one is `on_lost(process, why)`."""

  def __init__(self, timeout_s: float, on_timeout, peer_lost=None, on_lost=None):
    self.timeout_s = timeout_s
    self.on_timeout, self.peer_lost, self.on_lost = on_timeout, peer_lost, on_lost
    self._waiting: list = []  # (deadline, arrays, process, what)
    self._lock = threading.Lock()
    threading.Thread(target=self._loop, name="pull-watchdog", daemon=True).start()

  def watch(self, value, process: int, what: str) -> None:
    with self._lock:
      deadline = time.monotonic() + self.timeout_s
      self._waiting.append((deadline, jax.tree.leaves(value), process, what))

  def _loop(self) -> None:
    while True:
      time.sleep(min(0.5, self.timeout_s / 4))
      now = time.monotonic()
      with self._lock:
        waiting = [w for w in self._waiting if not all(x.is_ready() for x in w[1])]
        late = [w for w in waiting if w[0] <= now]
        self._waiting = [w for w in waiting if w[0] > now]
      for _, _, _, what in late:
        self.on_timeout(
          f"{what} has not arrived after {self.timeout_s:.0f} s "
          "(backend.pull_timeout_s): that process is dead or silent"
        )
      if self.peer_lost is None:
        continue
      for process in sorted({w[2] for w in waiting}):
        why = self.peer_lost(process)
        if why is not None:
          with self._lock:
            self._waiting = [w for w in self._waiting if w[2] != process]
          self.on_lost(process, why)


def _stop_process(message: str) -> None:
  log.error("%s; stopping this process so that the run restarts", message)
  logging.shutdown()
  console.flush()
  os._exit(1)


def _host() -> str:
  """The address this process's server listens on: the host of JAX's cross-host transfer socket
  (backend/distributed.py sets it), as an IP address."""
  address = jax.config.read("jax_cross_host_transfer_socket_address") or "127.0.0.1:0"
  host = address.rpartition(":")[0].strip("[]") or "127.0.0.1"
  return socket.gethostbyname(host)
