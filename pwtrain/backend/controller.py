"""The single controller: compiles each piece once per island and dispatches asynchronously.

Every island has one scheduler thread draining one FIFO queue, so all devices of an island run
the computations of every program in the same order (gang scheduling: interleaved programs can
never deadlock on each other's collectives). `run` enqueues every node of a program under one
lock and returns futures at once; a node's future resolves when the node has been *launched*
(its outputs are then un-ready jax.Arrays), not when it has finished, so the controller never
waits for a predecessor's data before enqueueing its successor. `max_inflight` bounds how many
earlier programs may still be unfinished when a new one is enqueued (0: run synchronously).

Several clients (threads, each with its own programs) may share one controller and its islands:
`run` is thread-safe, every program is enqueued atomically (so each island sees the programs in
one global order), and the run-ahead bound counts all clients' programs together.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
from typing import Any

import jax

from pwtrain import sharding as sharding_lib
from pwtrain.backend import pulls as pulls_lib
from pwtrain.backend.cluster import Cluster
from pwtrain.backend.program import Node, Program, Transfer
from pwtrain.backend.scheduler import CompletionWatcher, IslandScheduler, Work, here_only
from pwtrain.backend.trace import Trace
from pwtrain.backend.transfers import device_put, dispatch_order, has_local_devices
from pwtrain.sharding import stand_in

CROSS = "cross-process"  # the scheduler of transfers between processes (distributed mode)
_CONTROLLERS = itertools.count()  # names each controller's pulls alike on every process


@dataclasses.dataclass(frozen=True)
class Executable:
  """A function lowered and compiled once for one island's mesh."""

  name: str
  island: str
  compiled: Any  # jax.stages.Compiled (remote: compiled locally only if inspected)
  num_outputs: int
  remote: Any = None  # remote islands: the worker's copy (backend.remote.dispatch)
  donate_argnums: tuple[int, ...] = ()  # arguments whose buffers it may reuse (then gone)

  def memory_analysis(self):
    return self.compiled.memory_analysis()


class Controller:
  """Compiles and dispatches for a cluster.

  `serialize_execution` (default: on for CPU devices) makes each launched computation run to
  completion before the next one starts, across all islands. XLA's CPU runtime runs the
  per-device parts of a collective on a shared thread pool; several multi-device computations
  in flight at once (two islands, or steps run ahead) can occupy every thread with waiting
  participants and deadlock (XLA aborts after 40 s). GPUs and TPUs have no such limit. The
  controller still never waits: the island schedulers do.
  """

  def __init__(
    self,
    cluster: Cluster,
    *,
    max_inflight: int = 1,
    trace: Trace | None = None,
    serialize_execution: bool | None = None,
  ):
    if max_inflight < 0:
      raise ValueError(f"backend.max_inflight_steps={max_inflight} must be >= 0")
    self.cluster = cluster
    self.trace = trace
    self.max_inflight = max_inflight
    if serialize_execution is None:
      serialize_execution = any(d.platform == "cpu" for i in cluster.islands for d in i.devices)
    serial = threading.Lock() if serialize_execution else None
    # Remote islands schedule on their workers; the controller only sends them programs.
    self._remote = None
    if cluster.remote:
      from pwtrain.backend.remote.dispatch import RemoteDispatcher  # grpc: remote mode only

      self._remote = RemoteDispatcher(cluster, trace)
    self._schedulers = {
      i.name: IslandScheduler(i.name, trace, serial)
      for i in cluster.islands
      if self._remote is None
    }
    # Cross-process transfers, sent and received in program order from one thread (see
    # _dispatch_local: every process issues every one, in the same order).
    self._cross = IslandScheduler(CROSS, trace, None) if self._remote is None else None
    # Distributed mode: which islands have devices of this process. Every process walks every
    # program in the same order but launches only its own islands' nodes; another process's
    # node leaves a stand-in (an array with no data here) that a transfer can read from.
    self._here = {i.name: has_local_devices(i) for i in cluster.islands}
    self._last_cross: concurrent.futures.Future | None = None  # the last one enqueued
    self._prepared_programs: dict = {}  # id(program) -> (program, order, puts, pulls)
    # Transfers between processes by pull (backend/pulls.py), where they can go that way.
    self._id = next(_CONTROLLERS)
    self._distributed = self._remote is None and jax.process_count() > 1
    self._puller: pulls_lib.Puller | None = None
    # Traced: a pull's event runs from the pull to the data's arrival (on "<island>:pulls").
    traced = trace is not None and trace.record_completion and self._distributed
    self._pull_watcher = CompletionWatcher("pulls") if traced else None
    self._dispatch_lock = threading.Lock()
    # Guards `_inflight`, which clients on several threads append to and pop from; never held
    # while waiting, so one client's wait does not stall another's dispatch.
    self._inflight_lock = threading.Lock()
    self._inflight: collections.deque = collections.deque()
    self._step = 0

  def runs_here(self, island: str) -> bool:
    """Whether this process launches `island`'s nodes (always, outside distributed mode)."""
    return self._here[island]

  # -- compilation --------------------------------------------------------------------------

  def compile(
    self,
    name: str,
    fn,
    island: str,
    args,
    *,
    mesh=None,
    rules=sharding_lib.DEFAULT_RULES,
    in_shardings=None,
    out_shardings=None,
    donate_argnums=(),
  ) -> Executable:
    """Lowers `fn` for abstract `args` (ShapeDtypeStructs with shardings) and compiles it.

    With `mesh`, the model's logical activation constraints are resolved on it while tracing.
    """
    self.cluster[island]  # fail early on an unknown island
    if self._remote is not None:  # exported as StableHLO and compiled by the island's worker
      remote, num_outputs, local = self._remote.compile(
        name,
        island,
        fn,
        args,
        lambda: (
          sharding_lib.activate(mesh, rules) if mesh is not None else contextlib.nullcontext()
        ),
        mesh=mesh,
        out_shardings=out_shardings,
        donate_argnums=donate_argnums,
      )
      return Executable(name, island, local, num_outputs, remote, tuple(donate_argnums))
    jitted = jax.jit(
      fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums
    )
    if mesh is not None:
      with sharding_lib.activate(mesh, rules):
        lowered = jitted.lower(*args)
    else:
      lowered = jitted.lower(*args)
    out_tree = lowered.out_info
    num_outputs = len(out_tree) if isinstance(out_tree, tuple) else 1
    return Executable(name, island, lowered.compile(), num_outputs, None, tuple(donate_argnums))

  # -- dispatch -----------------------------------------------------------------------------

  def run(self, program: Program, inputs: dict[str, Any]) -> dict[str, concurrent.futures.Future]:
    """Enqueues every node of `program`; returns a future per program output, immediately.

    Blocks only to honour `max_inflight` (waiting for the oldest in-flight program's results).
    """
    missing = program.inputs - set(inputs)
    assert not missing, f"program inputs not given: {sorted(missing)}"
    self._bound_inflight()
    with self._dispatch_lock:
      step = self._step
      self._step += 1
      if self._remote is not None:  # every island's operations go out at once, as RPCs
        outputs = self._remote.dispatch(program, inputs, step)
      else:
        outputs = self._dispatch_local(program, inputs, step)
    with self._inflight_lock:
      self._inflight.append([f for k, f in outputs.items() if k not in program.carried])
    return outputs

  def _dispatch_local(self, program: Program, inputs: dict, step: int) -> dict:
    futures: dict[str, concurrent.futures.Future] = {}

    def resolve(ref):
      if isinstance(ref, str):
        return inputs[ref]
      node_name, index = ref
      return _select(futures[node_name], index)

    island_of = {n.name: n.island for n in program.nodes}
    order, puts, pulls = self._prepared(program)
    for node in order:
      scheduler = None  # the island's
      if isinstance(node, Node):
        if not self._here[node.island]:  # another process runs it
          futures[node.name] = _resolved(jax.tree.map(stand_in, node.executable.compiled.out_info))
          continue
        launch = node.executable.compiled
        args = [resolve(r) for r in node.args]
      else:
        assert isinstance(node, Transfer)
        if node.name in pulls:
          futures[node.name] = self._by_pull(node, pulls[node.name], island_of, resolve, step)
          continue
        host_value = isinstance(node.src, str)
        if not self._here[node.island] and host_value:
          futures[node.name] = _resolved(None)  # a host value: its island's process puts it
          continue
        # A cross-process transfer goes to the one queue of such transfers and never holds the
        # CPU lock. Every process issues every one of them, in program order, including those
        # between two other processes (on stand-ins, moving nothing here): JAX matches a
        # cross-host transfer's two sides by how many each process has issued before it.
        src_here = host_value or self._here[island_of[node.src[0]]]
        if not (self._here[node.island] and src_here):
          scheduler = self._cross
        launch = puts[node.name]
        args = [resolve(node.src)]
      if scheduler is self._cross:
        futures[node.name] = self._enqueue(node.name, node.island, launch, args, step, scheduler)
        self._last_cross = futures[node.name]
      else:
        # Launched only once every cross-process transfer enqueued before it has been issued:
        # a device runs a send issued after its next computation only after that computation
        # (measured: 1F1B's sends of a gradient waited a whole backward). No deadlock: the
        # transfers before it in program order never wait on it.
        futures[node.name] = self._enqueue(
          node.name, node.island, launch, args, step, after=self._last_cross
        )
    return {key: resolve(ref) for key, ref in program.outputs.items()}

  def _prepared(self, program: Program) -> tuple:
    """(transfers.dispatch_order of `program`, {transfer name: its device_put}, {transfer name:
    pulls.Pull} of those between processes that go by pull), made once per program: the
    dispatch of every step reuses them."""
    cached = self._prepared_programs.get(id(program))
    if cached is None or cached[0] is not program:
      order = dispatch_order(program, self.cluster.islands)
      puts = {n.name: device_put(n.sharding) for n in order if isinstance(n, Transfer)}
      pulls = pulls_lib.pulls(program, self.cluster.islands) if self._distributed else {}
      if pulls and self._puller is None:  # every process prepares the same programs
        self._puller = pulls_lib.Puller(f"transfer_servers/{self._id}")
      cached = self._prepared_programs[id(program)] = (program, order, puts, pulls)
    return cached[1:]

  def _by_pull(self, node: Transfer, pull, island_of, resolve, step: int):
    """A transfer between processes by pull, from the two islands' queues at its place in the
    dispatch order: the source's process offers the value once its node has been launched, the
    destination's pulls it (an array that is ready when the data has arrived; pulled there, not
    at dispatch, so that its buffer exists only from then: 1F1B's memory bound). A future of
    what this process holds of the result (the others: stand-ins)."""
    uuid = pull.uuid(self._id, step)
    here = jax.process_index()
    if here == pull.destination:
      event = None
      if self._pull_watcher is not None:  # from the pull to the data's arrival
        event = self.trace.add(node.name, f"{node.island}:pulls", step)

      def receive():
        value = self._puller.pull(pull.source, uuid, pull.spec)
        if event is not None:
          event.launch = self.trace.now()
          self._pull_watcher.watch(value, event, self.trace)
        return value

      return self._enqueue(node.name, node.island, receive, [], step, traced=False, computes=False)
    if here == pull.source:
      value = resolve(node.src)

      def offer():
        try:
          computed = value.result()
        except Exception as e:  # noqa: BLE001 - the receiver fails with it, not waits forever
          self._puller.offer_error(uuid, pull.offered, f"{node.name}: {e}")
          raise
        self._puller.offer(uuid, computed)

      self._enqueue(node.name, island_of[node.src[0]], offer, [], step, computes=False)
    return _resolved(jax.tree.map(stand_in, pull.spec))

  def _enqueue(
    self, name, island, launch, args, step, scheduler=None, after=None, traced=True, computes=True
  ):
    """Queues a launch on `island`'s scheduler (or `scheduler`), to start once the future
    `after` (if any) is done; a future of its result. `computes=False`: an offer or a pull
    (scheduler.IslandScheduler)."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    event = self.trace.add(name, island, step) if self.trace and traced else None
    work = Work(name, launch, args, out, event, after, computes)
    (scheduler or self._schedulers[island]).queue.put(work)
    return out

  def _bound_inflight(self):
    # Check and pop under the lock: two clients seeing one program left would otherwise both
    # pop it (IndexError). With several clients the bound is per pop, so it may be exceeded by
    # at most one program per concurrently waiting client.
    while (oldest := self._pop_inflight(keep=self.max_inflight)) is not None:
      _wait_outputs(oldest)

  def wait(self):
    """Blocks until everything dispatched so far (by any client) has finished."""
    while (oldest := self._pop_inflight(keep=0)) is not None:
      _wait_outputs(oldest)

  def _pop_inflight(self, keep: int):
    with self._inflight_lock:
      return self._inflight.popleft() if len(self._inflight) > keep else None

  def close(self):
    for scheduler in self._schedulers.values():
      scheduler.stop()
    if self._cross is not None:
      self._cross.stop()
    if self._pull_watcher is not None:
      self._pull_watcher.stop()
    if self._remote is not None:
      self._remote.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _wait_outputs(futures: list) -> None:
  """Waits until a program's outputs are computed or have failed; never raises.

  The program may belong to another client (the bound is shared): its error is for its owner,
  who sees it through its own futures, not for whoever happens to wait on it here.
  """
  for f in futures:
    try:
      jax.block_until_ready(here_only(f.result()))
    except Exception:  # noqa: BLE001 - reported through `f` to the program's owner
      pass


def _resolved(value) -> concurrent.futures.Future:
  out: concurrent.futures.Future = concurrent.futures.Future()
  out.set_result(value)
  return out


def _select(future: concurrent.futures.Future, index: int) -> concurrent.futures.Future:
  """A future for output `index` of a node's (tuple) result."""
  out: concurrent.futures.Future = concurrent.futures.Future()

  def done(f):
    if f.exception() is not None:
      out.set_exception(f.exception())
    else:
      value = f.result()
      out.set_result(value[index] if isinstance(value, tuple) else value)

  future.add_done_callback(done)
  return out
