"""The controller's local dispatch: one scheduler thread per island of this process.

Embedded mode's islands and distributed mode's: every island has one scheduler thread draining
one FIFO queue (backend/scheduler.py), so all devices of an island run the computations of every
program in the same order. In distributed mode every process walks every program in the same
order but launches only its own islands' nodes; another process's node leaves a stand-in (an
array with no data here) that a transfer can read from, and transfers between processes go by
pull where they can (backend/pulls.py) or by JAX's ordered cross-host device_put."""

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import threading

import jax

from pwtrain import sharding as sharding_lib
from pwtrain.backend import outline as outline_lib
from pwtrain.backend import pulls as pulls_lib
from pwtrain.backend import saved as saved_lib
from pwtrain.backend.cluster import Cluster
from pwtrain.backend.completion import CompletionWatcher, stamp
from pwtrain.backend.faults import IslandLost
from pwtrain.backend.futures import resolved, select
from pwtrain.backend.policy import PriorityPolicy
from pwtrain.backend.program import Executable, Node, Program, Transfer
from pwtrain.backend.scheduler import DEFAULT_LAUNCH_WINDOW, IslandScheduler, Work
from pwtrain.backend.trace import Trace
from pwtrain.backend.transfers import device_put, dispatch_order, has_local_devices
from pwtrain.sharding import stand_in

CROSS = "cross-process"  # the scheduler of transfers between processes (distributed mode)
_DISPATCHERS = itertools.count()  # names each controller's pulls alike on every process
log = logging.getLogger(__name__)


class LocalDispatcher:
  """Compiles with `jax.jit` and launches on this process's devices (see the module doc).

  `serialize_execution` (default: on for CPU devices), `compile_everywhere`, `launch_window`:
  see backend.Controller."""

  def __init__(
    self,
    cluster: Cluster,
    trace: Trace | None,
    serialize_execution: bool | None,
    pulls: pulls_lib.PullDeadlines,
    compile_everywhere: bool = False,
    launch_window: int = DEFAULT_LAUNCH_WINDOW,
  ):
    self.cluster = cluster
    self._compile_everywhere = compile_everywhere
    # XLA compiles (or loads from the persistent cache) on these threads while the caller
    # traces the next piece: see `compile`.
    self._compiler = concurrent.futures.ThreadPoolExecutor(
      max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="compile"
    )
    self._compiling: dict[int, list] = {}  # thread -> the futures of its compiles
    self._compiling_lock = threading.Lock()
    self._saved: dict[int, saved_lib.SavedExecutables] = {}  # thread -> its own: see `saving`
    self.trace = trace
    if serialize_execution is None:
      serialize_execution = any(d.platform == "cpu" for i in cluster.islands for d in i.devices)
    serial = threading.Lock() if serialize_execution else None
    # The devices of lost islands: reading an array deleted with one is that island's loss.
    self._lost_devices: dict = {}
    self.policy = PriorityPolicy()  # where priority programs go (backend/policy.py)
    place = self.policy.place_held  # as work finishes: the programs held back for their share
    self._schedulers = {
      i.name: IslandScheduler(i.name, trace, serial, self._lost_devices, launch_window, place)
      for i in cluster.islands
    }
    self.publishing = False  # see Controller.start_publishing
    # Cross-process transfers, sent and received in program order from one thread (see
    # dispatch: every process issues every one, in the same order).
    self._cross = IslandScheduler(CROSS, trace, None, self._lost_devices, executes=False)
    # Distributed mode: which islands have devices of this process. Every process walks every
    # program in the same order but launches only its own islands' nodes; another process's
    # node leaves a stand-in (an array with no data here) that a transfer can read from.
    self._here = {i.name: has_local_devices(i) for i in cluster.islands}
    self._last_cross: concurrent.futures.Future | None = None  # the last one enqueued
    self._prepared_programs: dict = {}  # id(program) -> (program, order, puts, pulls)
    # Transfers between processes by pull (backend/pulls.py), where they can go that way.
    self._id = next(_DISPATCHERS)
    self._distributed = jax.process_count() > 1
    self._puller: pulls_lib.Puller | None = None
    self._pull_deadlines = pulls
    # Traced: a pull's event runs from the pull to the data's arrival (on "<island>:pulls").
    traced = trace is not None and trace.record_completion and self._distributed
    self._pull_watcher = CompletionWatcher("pulls") if traced else None

  def lose(self, island: str, cause: str) -> None:
    """Marks `island` lost: from now on its work fails with IslandLost, unlaunched; and in one
    process (embedded mode, whose losses are drills), every array its work made is deleted, as
    a real loss leaves them: whatever reads one then fails with this IslandLost
    (faults.read_of_lost), so nothing can be copied from a lost island."""
    lost = self._schedulers[island].lost = IslandLost(island, cause)
    self._lost_devices.update(dict.fromkeys(self.cluster[island].devices, lost))
    if not self._distributed:
      self._schedulers[island].delete_made()

  def restore(self, island: str) -> None:
    """`island` runs again (its devices are back), with nothing published on it (cleared before
    its work can launch): a reader waits for the state copied there (NotPublished)."""
    self._schedulers[island].published.clear()
    self._schedulers[island].lost = None
    for device in self.cluster[island].devices:
      self._lost_devices.pop(device, None)

  def lost(self) -> dict[str, str]:
    return {name: s.lost.cause for name, s in self._schedulers.items() if s.lost is not None}

  def answering(self) -> set[str]:
    return set()  # a lost island's devices come back only by a drill (`restore`)

  def runs_here(self, island: str) -> bool:
    """Whether this process launches `island`'s nodes (always, outside distributed mode)."""
    return self._here[island]

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
    """`fn` lowered for abstract `args` and compiled (see Controller.compile); for an island
    another process runs, only traced, to its Outline (backend/outline.py) where that tells its
    outputs' shardings (else compiled as well), unless `compile_everywhere`. Tracing and
    lowering run here; XLA's compile runs on a compile thread, so that the caller traces its
    next piece meanwhile, and the Executable's `compiled` waits for it (`wait_compiles` waits
    for all). While `saving` executables, a piece saved before is loaded instead of traced."""
    jitted = jax.jit(
      fn,
      in_shardings=in_shardings,
      out_shardings=outline_lib.without_kept(out_shardings),
      donate_argnums=donate_argnums,
    )
    compiles_here = self._here[island] or self._compile_everywhere or in_shardings is not None
    saved = self._saved.get(threading.get_ident()) if compiles_here else None
    key = None
    if saved is not None:
      devices = tuple(d.id for d in self.cluster[island].devices)
      key = saved.key(name, devices, saved_lib.abstract(args), donate_argnums, in_shardings,
                      out_shardings)  # fmt: skip
      if saved.loading:  # every piece loaded, none traced (backend/saved.py)
        num_outputs = saved.num_outputs(key)
        future = self._background(functools.partial(saved.load, key))
        return self._executable(name, island, future, num_outputs, donate_argnums)
    activate = sharding_lib.activate(mesh, rules) if mesh is not None else contextlib.nullcontext()
    with activate:
      if compiles_here:
        lowered = jitted.lower(*args)
      else:
        traced = jitted.trace(*args)
        compiled = outline_lib.outline(name, traced, args, out_shardings)
        lowered = None if compiled else traced.lower()
    out_tree = lowered.out_info if lowered is not None else compiled.out_info
    num_outputs = len(out_tree) if isinstance(out_tree, tuple) else 1
    if lowered is not None:

      def build():
        if key is None:
          return lowered.compile()
        compiled, fresh = saved_lib.compile_lowered(lowered)
        saved.save(key, compiled, num_outputs, fresh)
        return compiled

      compiled = self._background(build)
    return self._executable(name, island, compiled, num_outputs, donate_argnums)

  def _background(self, fn) -> concurrent.futures.Future:
    """`fn()` on a compile thread; the calling thread's `wait_compiles` waits for it."""
    future = self._compiler.submit(fn)
    with self._compiling_lock:
      mine = self._compiling.setdefault(threading.get_ident(), [])
      mine[:] = [f for f in mine if not f.done() or f.exception()]
      mine.append(future)
    return future

  @staticmethod
  def _executable(name, island, compiled, num_outputs, donate_argnums) -> Executable:
    return Executable(name, island, compiled, num_outputs, None, tuple(donate_argnums))

  @contextlib.contextmanager
  def saving(self, saved: saved_lib.SavedExecutables):
    """Within: the pieces this thread compiles are loaded from, or saved in, `saved`
    (backend/saved.py); other clients' compiles meanwhile are not."""
    self._saved[threading.get_ident()] = saved
    try:
      yield
    finally:
      del self._saved[threading.get_ident()]

  def wait_compiles(self) -> None:
    """Blocks until every compile this thread started has ended; raises the first one's error."""
    with self._compiling_lock:
      mine = self._compiling.pop(threading.get_ident(), [])
    for future in mine:
      future.result()

  def dispatch(self, program: Program, inputs: dict, step: int, priority: bool = False) -> dict:
    """Enqueues every node of `program` on its island's queue (this process's islands: see
    `runs_here`); a future per program output. `priority`: placed by the policy
    (backend/policy.py) rather than at the end of each queue."""
    futures: dict[str, concurrent.futures.Future] = {}
    placed: list | None = [] if priority else None  # priority work: placed together at the end
    publishes = {} if priority else self._publishes(program)  # a priority client's are its own

    def resolve(ref):
      if isinstance(ref, str):
        return inputs[ref]
      node_name, index = ref
      return select(futures[node_name], index)

    island_of = {n.name: n.island for n in program.nodes}
    order, puts, pulls = self._prepared(program)
    for node in order:
      scheduler = None  # the island's
      if isinstance(node, Node):
        if not self._here[node.island]:  # another process runs it
          futures[node.name] = resolved(jax.tree.map(_stand_in, node.executable.compiled.out_info))
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
          futures[node.name] = resolved(None)  # a host value: its island's process puts it
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
          node.name, node.island, launch, args, step, after=self._last_cross, placed=placed,
          publishes=publishes.get(node.name, ()), begins=isinstance(node, Node) or not host_value,
        )  # fmt: skip
    if placed:
      self.policy.insert(placed, step)
    return {key: resolve(ref) for key, ref in program.outputs.items()}

  def _publishes(self, program: Program) -> dict[str, tuple]:
    """While `publishing`: {node name: ((carried output's name, its output index), ...)}."""
    out: dict[str, tuple] = {}
    if self.publishing:
      for key in program.carried:
        ref = program.outputs[key]
        if not isinstance(ref, str):  # a value passed through as it is was published before
          out[ref[0]] = (*out.get(ref[0], ()), (key, ref[1]))
    return out

  def publish(self, island: str, name: str, value, step: int) -> concurrent.futures.Future:
    """Publishes `value` under `name` on `island` at this point of its queue (program.Latest)."""
    publishes = ((name, None),)
    return self._enqueue(name, island, lambda: value, [], step, computes=False, publishes=publishes)

  def set_priority_share(self, share: float) -> None:
    self.policy.set_share(share, self._schedulers.values())

  def set_launch_window(self, window: int) -> None:
    for scheduler in self._schedulers.values():
      scheduler.set_window(window)

  def island_time(self) -> dict[str, dict[str, float]]:
    """{island: {"priority", "ordinary"}}: each island's busy seconds so far (policy.py)."""
    return {name: s.clock.totals() for name, s in self._schedulers.items()}

  def _prepared(self, program: Program) -> tuple:
    """(transfers.dispatch_order of `program`, {transfer name: its device_put}, {transfer name:
    pulls.Pull} of those between processes that go by pull), made once per program: the
    dispatch of every step reuses them."""
    cached = self._prepared_programs.get(id(program))
    if cached is None or cached[0] is not program:
      outline_lib.check_reads(program)
      order = dispatch_order(program, self.cluster.islands)
      puts = {n.name: device_put(n.sharding) for n in order if isinstance(n, Transfer)}
      pulls = pulls_lib.pulls(program, self.cluster.islands) if self._distributed else {}
      if pulls:  # every process prepares the same programs
        self.serve_pulls()
      cached = self._prepared_programs[id(program)] = (program, order, puts, pulls)
    return cached[1:]

  def serve_pulls(self) -> pulls_lib.Puller:
    """This process's transfer server, started on first use."""
    if self._puller is None:
      d, name = self._pull_deadlines, f"transfer_servers/{self._id}"
      self._puller = pulls_lib.Puller(name, d.timeout_s, None, d.peer_lost, d.recoverable)
    return self._puller

  def hand_over(self, value, source: int, destination: int, spec, step: int):
    """`value` (arrays on process `source`'s devices) as arrays of `spec` on process
    `destination`'s, by one pull named by program number `step` (elastic pods: a returning
    process's state, from a live pod's); stand-ins of `spec` on every other process. Every
    process calls it alike."""
    uuid = pulls_lib.Pull(source, destination, spec, None, 0).uuid(self._id, step)
    here = jax.process_index()
    if here == destination:
      return self.serve_pulls().pull(source, uuid, spec)
    if here == source:
      self.serve_pulls().offer(uuid, value)
    return jax.tree.map(stand_in, spec)

  def forget(self, process: int) -> None:
    """`process` was started again: the next pull from it connects to its new server."""
    if self._puller is not None:
      self._puller.forget(process)

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
          self._pull_watcher.watch(value, stamp(event, self.trace))
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
    return resolved(jax.tree.map(stand_in, pull.spec))

  def _enqueue(
    self, name, island, launch, args, step, scheduler=None, after=None, traced=True, computes=True,
    placed=None, publishes=(), begins=True,
  ):  # fmt: skip
    """Queues a launch on `island`'s scheduler (or `scheduler`), to start once the future
    `after` (if any) is done; a future of its result. `computes=False`: an offer, a pull or a
    publication (scheduler.IslandScheduler). With `placed` (a list), the work is added to it for
    the policy to place (policy.PriorityPolicy.insert). `publishes`, `begins`: scheduler.Work's."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    event = self.trace.add(name, island, step) if self.trace and traced else None
    scheduler = scheduler or self._schedulers[island]
    w = Work(name, launch, args, out, event, after, computes, (step, 0), False, publishes, begins)
    if placed is not None:
      placed.append((scheduler, w))
    else:
      scheduler.queue.put(w)
    return out

  def close(self) -> None:
    self._compiler.shutdown(wait=True, cancel_futures=True)
    self.policy.place_held(everything=True)  # before the stop: every program runs or fails
    for stoppable in (*self._schedulers.values(), self._cross, self._pull_watcher):
      if stoppable is not None:
        stoppable.stop()


def _stand_in(info):
  """sharding.stand_in, or None for an output whose sharding is unknown here (outline.KEPT: no
  transfer reads it, outline.check_reads)."""
  return None if info.sharding is None else stand_in(info)
