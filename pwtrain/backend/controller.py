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
one global order), and the run-ahead bound counts all clients' programs together. A priority
client (`run(priority=True)`: serving) has its programs placed ahead of queued ordinary work
within a share of each island's time (backend/policy.py; remote workers place them ahead of
their queued work, without a share: remote/sending.py); they are not
counted in the bound (their client waits for each). While the controller publishes
(`start_publishing`), the carried outputs of every ordinary program (a train state) are
published on their islands as their nodes launch (remote: as they run on the worker), and a
node can read the newest of them in place (`program.Latest`).
"""

import collections
import concurrent.futures
import contextlib
import threading
from typing import Any

import jax
import jax.numpy as jnp

from pwtrain import sharding as sharding_lib
from pwtrain.backend.cluster import Cluster
from pwtrain.backend.completion import here_only
from pwtrain.backend.dispatch import LocalDispatcher
from pwtrain.backend.faults import IslandLost, read_of_lost
from pwtrain.backend.program import Executable, Latest, Program
from pwtrain.backend.pulls import PullDeadlines
from pwtrain.backend.scheduler import DEFAULT_LAUNCH_WINDOW
from pwtrain.backend.trace import Trace
from pwtrain.errors import ConfigError

__all__ = ["Controller", "Executable"]  # Executable: backend.program


class Controller:
  """Compiles and dispatches for a cluster, through its dispatcher: a `LocalDispatcher` for
  this process's islands (embedded and distributed modes), a `RemoteDispatcher` for island
  workers (remote mode).

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
    pulls: PullDeadlines | None = None,
    compile_everywhere: bool = False,
    donate: bool = True,
    launch_window: int = DEFAULT_LAUNCH_WINDOW,
  ):
    """`donate=False`: compile every piece without donating its inputs, so that a program's
    inputs outlive it (elastic pods in distributed mode: a step may finish on some processes
    and fail on others, and all of them run it again from the state it started from), at the
    cost of holding both. `pulls`: distributed mode, when a transfer pulled from another process
    is given up, its peer taken for dead (backend/pulls.py: after a timeout, or once the peer's
    liveness says it is lost).
    `compile_everywhere`: distributed mode, compile other processes' islands' pieces too, as
    every process did before it traced them to outlines (`compile`); for
    experiments/bench_distributed.py's comparison of the two, nothing else. `launch_window`:
    where execution is not serialized, how many computations each island may have launched and
    not finished (0: no bound); the rest wait in its queue, where priority work can go ahead of
    them (backend/scheduler.py). Remote workers run each operation in turn, in their queue's order
    (remote/ordered.py)."""
    if max_inflight < 0:
      raise ConfigError(f"backend.max_inflight_steps={max_inflight} must be >= 0")
    if launch_window < 0:
      raise ConfigError(f"backend.launch_window={launch_window} must be >= 0 (0: no bound)")
    self.cluster = cluster
    self.trace = trace
    self.max_inflight = max_inflight
    self.donate = donate
    if cluster.remote:  # islands schedule on their workers; the controller sends programs
      from pwtrain.backend.remote.dispatch import RemoteDispatcher  # grpc: remote mode only

      self._dispatcher = RemoteDispatcher(cluster, trace)
    else:
      self._dispatcher = LocalDispatcher(
        cluster,
        trace,
        serialize_execution,
        pulls or PullDeadlines(),
        compile_everywhere,
        launch_window,
      )
    self._dispatch_lock = threading.Lock()
    # Guards `_inflight`, which clients on several threads append to and pop from; never held
    # while waiting, so one client's wait does not stall another's dispatch.
    self._inflight_lock = threading.Lock()
    self._inflight: collections.deque = collections.deque()
    self._step = 0

  def runs_here(self, island: str) -> bool:
    """Whether this process launches `island`'s nodes (always, outside distributed mode)."""
    return self._dispatcher.runs_here(island)

  # -- lost islands (backend/faults.py) ------------------------------------------------------

  def lose(self, island: str, cause: str) -> None:
    """Makes `island` lost, as a fault would (a drill, `cause`): embedded, every node of it
    fails with IslandLost from now on, and so does whatever reads its outputs; remote, its
    worker is killed, and the calls that fail and the health monitor find it lost."""
    self.cluster[island]
    self._dispatcher.lose(island, cause)

  def restore(self, island: str) -> None:
    """`island` can run again (it rejoins at the next program); remote: waits until its worker
    answers, which then compiles again every executable it had."""
    self._dispatcher.restore(island)

  @property
  def lost(self) -> dict[str, str]:
    """{island: cause} of the islands lost now."""
    return self._dispatcher.lost()

  def read(self, value, *, fetch: bool = True):
    """`value` (arrays, or trees of them) on the host, or, not `fetch`ed, once computed. A read
    that fails because one of its arrays was deleted with a lost island (as a real loss leaves
    them; embedded drills delete them) raises that island's IslandLost; any other failure is
    raised as it is."""
    try:
      return jax.device_get(value) if fetch else jax.block_until_ready(value)
    except RuntimeError as e:
      lost = {
        device: IslandLost(name, cause)
        for name, cause in self.lost.items()
        for device in self.cluster[name].devices
      }
      raise read_of_lost(value, lost) or e from None

  def computed(self, outputs: dict) -> None:
    """Waits until every value of `outputs` (a program's: futures of arrays, or remote values)
    is computed, fetching nothing; a value that waited on a lost island fails as in `read`.
    Remote: each worker answers once its value is there, its pulls from other workers included
    (a pull from a worker declared lost fails: WorkerLost); a value on a lost worker is left
    out (remote/values.wait_computed)."""
    if self.cluster.remote:
      from pwtrain.backend.remote.values import wait_computed  # grpc: remote mode only

      wait_computed(outputs.values())
    else:
      from pwtrain.backend.run_mode import results  # orbax: not where a worker imports this

      self.read(results(outputs), fetch=False)

  def answering(self) -> set[str]:
    """The lost islands that answer again and may rejoin (remote: their workers were
    relaunched or restarted; embedded islands come back only by a drill)."""
    return self._dispatcher.answering()

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
    `out_shardings` leaves may be `outline.KEPT`: the compiler's choice (as None), of an
    output only pieces of the same island read. Distributed mode: a piece of an island this
    process does not run (`runs_here`) is traced, not compiled, where `out_shardings` fixes
    every output's sharding but KEPT ones: its Executable's `compiled` is then an Outline
    (backend/outline.py), which answers its shapes and shardings only. Remote mode: the
    island's worker compiles it (backend/remote/dispatch.py). Local islands compile on
    background threads while the caller traces on: the Executable's `compiled` waits for its
    compile, `wait_compiles` for all.
    """
    self.cluster[island]  # fail early on an unknown island
    return self._dispatcher.compile(
      name,
      fn,
      island,
      args,
      mesh=mesh,
      rules=rules,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      donate_argnums=donate_argnums if self.donate else (),
    )

  @property
  def saves_pieces(self) -> bool:
    """Whether `saving` keeps compiled pieces: local islands of a single process (remote
    workers and distributed mode trace every piece at every start)."""
    return not self.cluster.remote and jax.process_count() == 1

  def saving(self, saved):
    """A context within which compiled pieces are loaded from, or saved in, `saved` (a
    backend.saved.SavedExecutables), where the controller `saves_pieces`."""
    if not self.saves_pieces:
      return contextlib.nullcontext()
    return self._dispatcher.saving(saved)

  def wait_compiles(self) -> None:
    """Blocks until every compile started so far has ended (local dispatch compiles on
    background threads: LocalDispatcher.compile); raises the first one's error."""
    self._dispatcher.wait_compiles()

  # -- dispatch -----------------------------------------------------------------------------

  def run(
    self, program: Program, inputs: dict[str, Any], *, priority: bool = False
  ) -> dict[str, concurrent.futures.Future]:
    """Enqueues every node of `program`; returns a future per program output, immediately.

    Blocks only to honour `max_inflight` (waiting for the oldest in-flight program's results).
    `priority`: placed ahead of queued ordinary work by the islands' policy, or held back until
    its share allows it (backend/policy.py: its inputs may be program.Latest values and the
    client's own earlier outputs only; its futures resolve once it is placed and launched), and
    neither bounded nor waited for by `wait` (its client waits for it). Remote: placed ahead
    of the work queued on its workers that none of them has begun, at one place on all of
    them, without a share (remote/sending.py). Not in distributed mode.
    """
    missing = program.inputs - set(inputs)
    assert not missing, f"program inputs not given: {sorted(missing)}"
    if priority:
      self._one_controller("priority programs")
    else:
      self._bound_inflight()
    with self._dispatch_lock:
      step = self._step
      self._step += 1
      outputs = self._dispatcher.dispatch(program, inputs, step, priority)
    if not priority:
      with self._inflight_lock:
        self._inflight.append([f for k, f in outputs.items() if k not in program.carried])
    return outputs

  # -- sharing islands with a priority client (backend/policy.py) ----------------------------

  def set_priority_share(self, share: float) -> None:
    """The share of each island's time that priority work may take ahead of queued ordinary
    work under saturating load (policy.PriorityPolicy), in (0, 1]."""
    if not 0 < share <= 1:
      raise ConfigError(f"priority share {share} must be in (0, 1]")
    self._local_only("a priority share")
    self._dispatcher.set_priority_share(share)

  def set_launch_window(self, window: int) -> None:
    """From now on, each local island launches at most `window` computations that have not
    finished (0: no bound), where execution is not serialized (backend/scheduler.py)."""
    if window < 0:
      raise ConfigError(f"launch window {window} must be >= 0 (0: no bound)")
    self._local_only("a launch window")
    self._dispatcher.set_launch_window(window)

  def start_publishing(self) -> None:
    """From now on, the carried outputs of every program (a train state) are published on their
    islands, under the output's name, as the nodes that produce them launch; a node reads the
    newest with a program.Latest input (backend/scheduler.py; remote: as the program that
    produces them is sent, since a worker runs its ops in the order they come)."""
    self._one_controller("publishing")
    self._dispatcher.publishing = True

  def publish(self, island: str, name: str, value) -> concurrent.futures.Future:
    """Publishes `value` (arrays on `island`) under `name` there, after everything enqueued so
    far (program.Latest); a future resolved once it is. Remote islands publish only a program's
    output made there: a value still on this host is left for the program that uploads it
    (remote/dispatch.py)."""
    self._one_controller("publishing")
    self.cluster[island]
    with self._dispatch_lock:
      step = self._step
      self._step += 1
      return self._dispatcher.publish(island, name, value, step)

  def publish_copy(self, island: str, name: str, source: str) -> concurrent.futures.Future:
    """Publishes under `name` on `island` a copy of the {"params", "step"} published as `source`
    there, read and copied when the island's queue reaches this point (after everything enqueued
    so far), so the programs enqueued later, which may donate `source`, leave it. Local only."""
    self._one_controller("publishing")
    read = Latest(source, ("params", "step"))
    with self._dispatch_lock:
      step, self._step = self._step, self._step + 1
      return self._dispatcher._enqueue(
        name, island, lambda v: jax.tree.map(jnp.copy, v), [read], step, publishes=((name, None),)
      )

  def island_time(self) -> dict[str, dict[str, float]]:
    """{island: {"priority", "ordinary"}}: the busy seconds each island spent on priority and on
    other work so far (exact where execution is serialized, as on CPU)."""
    self._local_only("island time")
    return self._dispatcher.island_time()

  def _local_only(self, what: str) -> None:
    if self.cluster.remote or jax.process_count() > 1:
      raise ConfigError(
        f"{what}: the controller's local islands of one process only (embedded mode)"
      )

  def _one_controller(self, what: str) -> None:
    if jax.process_count() > 1:
      raise ConfigError(f"{what}: one controller's islands (embedded or remote mode)")

  @property
  def program_number(self) -> int:
    """How many programs were dispatched: the next one's number, which names its pulls
    (distributed mode); a process that rejoins a run takes the others' (elastic pods)."""
    return self._step

  @program_number.setter
  def program_number(self, value: int) -> None:
    self._step = value

  def hand_over(self, value, source: int, destination: int, spec):
    """Distributed mode: `value` (arrays of process `source`) as arrays of `spec` on process
    `destination`, by one pull; counts as a program (dispatch.Dispatcher.hand_over)."""
    with self._dispatch_lock:
      step = self._step
      self._step += 1
      return self._dispatcher.hand_over(value, source, destination, spec, step)

  def serve_pulls(self) -> None:
    """Distributed mode: starts this process's transfer server now (else at the first program
    with a pull), publishing its address."""
    self._dispatcher.serve_pulls()

  def forget(self, process: int) -> None:
    """Distributed mode: `process` was started again; pulls from it go to its new server."""
    self._dispatcher.forget(process)

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
    self._dispatcher.close()

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
