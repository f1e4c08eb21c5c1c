"""An island's scheduler: one thread launching one queue of work in order, so that every device of
the island runs the computations of every program in the same order (gang scheduling;
backend/controller.py enqueues, the scheduler launches).

The queue is one order per island. Ordinary work joins at its end; a priority client's work may
be placed ahead of queued work that has not been taken yet (backend/policy.py says where), never
ahead of work already taken. Every item carries its place in that order (`Work.order`).

The launch window. Where computations run to completion one at a time (serialized execution,
CPU), the scheduler takes an item only once the one before it has finished. Elsewhere (GPUs,
TPUs) a launch returns at once and the computation runs later on the device, so the scheduler
takes computing work only while fewer than `launch_window` of the island's computing items are
launched and not finished (0: no bound): the rest wait in the queue, where priority work can
still go ahead of them. An item finishes when its outputs are ready on the device: a watcher
thread (`CompletionWatcher`) waits for them in launch order. A window of 2 keeps the device
busy (the next item is launched while one runs) and lets priority work wait for at most the
two launched ahead of it. While priority work is about (queued, in flight, or finished no longer
ago than the last ordinary item took: a client such as the serving engine comes back within
that), ordinary work keeps to a window of 1, so that priority work waits at most for the one
item running; priority work itself still has the whole window, and launches behind it.

A transfer of a program's input onto the island (a step's batch: `Work.begins=False`) waits on
no other work: it is launched outside the window, as soon as it reaches the head of the queue,
and taking it does not begin its program, so priority work may still go ahead of the program's
computations (were it counted, the batch of the step after the running one would take the
window's second place and make that step begun, and a priority program would wait for both).

Running times. Each island notes when each of its computations is launched (with those of its
inputs not there yet) and ends, so that the process can tell how long the one that runs has run
(backend/progress.py: a wedged process, distributed mode's `fault.progress_timeout_s`).

Published values. A node's outputs may be published when it launches (`Work.publishes`), and a
node may read, as an argument, the newest value published under a name on its island
(`program.Latest`), resolved when it launches. Both happen on the island's thread, in queue
order, so a reader placed between a program that donates a value and the one before it reads
the value before the donation: the controller's way of reading live training state in place.
"""

import concurrent.futures
import contextlib
import threading
import time
import weakref
from typing import Any

import jax

from pwtrain.backend.completion import CompletionWatcher, block_ready
from pwtrain.backend.completion import here_only as here_only  # backend.scheduler.here_only
from pwtrain.backend.faults import IslandLost, is_device_loss, read_of_lost
from pwtrain.backend.island_queue import OrderedQueue, Work
from pwtrain.backend.policy import IslandClock
from pwtrain.backend.program import Latest, NotPublished
from pwtrain.backend.progress import IslandRuns, watched
from pwtrain.backend.trace import Trace

# Computations an island may have launched and not finished where execution is not serialized
# (the module doc): chosen by experiments/bench_window.py (docs/benchmarks.md).
DEFAULT_LAUNCH_WINDOW = 2


class IslandScheduler:
  """One thread, one queue of `Work`: launches the island's work strictly in queue order."""

  def __init__(
    self,
    name: str,
    trace: Trace | None,
    serial,
    lost_devices: dict | None = None,
    launch_window: int = 0,
    progress=None,
    executes: bool = True,
  ):
    """`lost_devices`: {device: IslandLost} of the lost islands (the dispatcher's): a work whose
    input was deleted with one of them fails with its IslandLost. `launch_window`: see the
    module doc (serialized execution needs none: each item runs to completion). `progress`:
    called with no lock held whenever an item has finished (the policy places held work).
    `executes`: its computations are the process's execution, whose running times
    backend/progress.py tells (False: transfers between processes, waits on a peer)."""
    self.name = name
    self.trace = trace
    self.serial = serial
    self.queue = OrderedQueue(launch_window if serial is None else 0)
    # Set while the island is lost (backend/faults.py): every work fails with it, unlaunched.
    self.lost: IslandLost | None = None
    self.published: dict[str, Any] = {}  # name -> the newest value published here
    self.clock = IslandClock(window=self.queue.window)  # its busy time, priority's apart
    self.progress = progress
    # What runs now, where this process watches it (backend/progress.py).
    self.runs = IslandRuns(name) if executes and watched() else None
    self._lost_devices = {} if lost_devices is None else lost_devices
    self._made: dict[int, weakref.ref] = {}  # the arrays its work made that are alive
    # Unserialized: when each launched computation finishes (its trace event's end, the clock,
    # the window). Serialized: exact on this thread, nothing else runs meanwhile.
    self.watcher = CompletionWatcher(name, self._watch_error) if serial is None else None
    self._record = trace is not None and trace.record_completion
    self._last_done = 0.0
    self.thread = threading.Thread(target=self._loop, name=f"sched-{name}", daemon=True)
    self.thread.start()

  def set_window(self, window: int) -> None:
    """A new launch window, for the queue and the clock's credit alike (serialized execution
    takes none, as at the start)."""
    window = window if self.serial is None else 0
    self.queue.set_window(window)
    self.clock.window = window

  def _loop(self):
    while True:
      work = self.queue.get()
      if work is None:
        return
      outcome = None
      try:
        outcome = self._run(work)
      finally:
        if work.computes and outcome is not WATCHED:  # ran to completion, failed or never ran
          self._finished(work, outcome)
        elif not work.computes and self.progress is not None:
          self.progress()  # the island may be idle now: held priority work may be placed

  def _run(self, work: Work):
    """Launches `work`: WATCHED (the watcher finishes it), the seconds it ran to completion
    (serialized), or None (failed, or nothing to time)."""
    event = work.event
    if self.lost is not None:
      work.out.set_exception(self.lost)
      return None
    if work.after is not None:  # see Controller._dispatch_local
      concurrent.futures.wait([work.after])
    values = []
    outcome = None
    try:
      values = [self._value(a) for a in work.args]
      if not work.computes:  # offers, pulls, publications: return at once, no lock
        if event is not None:
          event.launch = self.trace.now()
        result = work.launch(*values)
        if event is not None:
          event.done = self.trace.now()
      elif self.serial is None:
        launched = time.perf_counter()
        if event is not None:
          event.launch = self.trace.now()
        self._launched(work, _not_ready(values) if self.runs is not None else ())
        with jax.profiler.TraceAnnotation(work.name):  # the node's name in a profiler trace
          result = work.launch(*values)
        self.watcher.watch(
          result, self._ready_callback(work, launched), self._finished_callback(work)
        )
        outcome = WATCHED
      else:
        # Inputs pulled from another process are awaited before the lock is taken: the
        # computation that sends them may wait on one of this process's (no cycle of waits).
        block_ready(values)
        with self.serial:  # see Controller: run to completion, one computation at a time
          launched = time.perf_counter()
          if event is not None:
            event.launch = self.trace.now()
          self._launched(work)
          with jax.profiler.TraceAnnotation(work.name):
            result = work.launch(*values)
            block_ready(result)
          if event is not None:  # exact: nothing else runs until this has finished
            event.done = self.trace.now()
          outcome = time.perf_counter() - launched
      for name, index in work.publishes:  # before the next work is taken: see the module doc
        self.published[name] = result if index is None else _output(result, index)
    except BaseException as e:  # noqa: BLE001 - forwarded to whoever waits on the future
      if is_device_loss(e):  # this island's devices are gone: every node of it is lost
        self.lost = IslandLost(self.name, str(e).splitlines()[0])
        e = self.lost
      elif self._lost_devices:  # it read an array that a lost island took with it
        e = read_of_lost(values, self._lost_devices) or e
      work.out.set_exception(e)
      return outcome
    self._remember(result)
    if self.lost is not None and work.computes:  # lost while it ran: its outputs go too
      self.delete_made()
      work.out.set_exception(self.lost)
      return outcome
    work.out.set_result(result)
    return outcome

  def _ready_callback(self, work: Work, launched: float):
    """Once `work`'s outputs are ready: its trace event's end, and its busy time on the clock
    (from its launch or its predecessor's end, whichever is later: one island runs its
    computations in launch order)."""
    event = work.event if self._record else None

    def ready() -> None:
      if self.runs is not None:
        self.runs.end(id(work))
      now = time.perf_counter()
      self.clock.add(work.priority, max(now - max(launched, self._last_done), 0.0), work)
      self._last_done = now
      if event is not None:
        event.done = self.trace.now()

    return ready

  def _launched(self, work: Work, awaits: list = ()) -> None:
    """`work` is launched, its inputs there but `awaits`: its running time begins."""
    if self.runs is not None:
      self.runs.launched(id(work), work.name, awaits)

  def _finished_callback(self, work: Work):
    def finished() -> None:
      if self.runs is not None:
        self.runs.end(id(work))
      self.queue.finished(work)
      if self.progress is not None:
        self.progress()

    return finished

  def _finished(self, work: Work, seconds: float | None) -> None:
    """`work` finished on this thread: `seconds` it ran (None: it failed or never ran)."""
    if seconds is None:
      self.clock.release(work.reserved)
    else:
      self.clock.add(work.priority, seconds, work)
    self._finished_callback(work)()

  def _watch_error(self, error: BaseException) -> None:
    """A launched computation failed on the device: a device loss loses the island (its owner
    reads any other error from the outputs)."""
    if is_device_loss(error) and self.lost is None:
      self.lost = IslandLost(self.name, str(error).splitlines()[0])

  def _value(self, arg):
    if isinstance(arg, concurrent.futures.Future):
      return arg.result()
    if isinstance(arg, Latest):
      if arg.name not in self.published:
        raise NotPublished(f"nothing is published as {arg.name!r} on {self.name} yet")
      value = self.published[arg.name]
      return {k: value[k] for k in arg.keys} if arg.keys else value
    return arg

  def _remember(self, result) -> None:
    for x in jax.tree.leaves(result):
      if isinstance(x, jax.Array):
        key = id(x)
        self._made[key] = weakref.ref(x, lambda _, key=key: self._made.pop(key, None))

  def delete_made(self) -> None:
    """Deletes every array this island's work made that is still alive (its loss, embedded:
    the arrays a real loss takes with it). Serialized execution (CPU): while no computation
    runs, since one reading an array deleted under it would crash; otherwise deleting under
    a running transfer's read is a real loss's race."""
    with self.serial if self.serial is not None else contextlib.nullcontext():
      for ref in list(self._made.values()):
        x = ref()
        if x is not None and not x.is_deleted():
          x.delete()

  def stop(self):
    self.queue.put(None)  # after everything queued: see _order
    self.thread.join()
    if self.watcher:
      self.watcher.stop()


WATCHED = "watched"  # IslandScheduler._run: the watcher finishes the item


def _not_ready(values) -> list:
  """The arrays among `values` (a computation's inputs, at its launch) whose data has not
  arrived yet: a pulled input, or an earlier computation's output."""
  return [
    x
    for x in here_only(values)
    if isinstance(x, jax.Array) and not x.is_deleted() and not x.is_ready()
  ]


def _output(result, index: int):
  """Output `index` of a node's result (a tuple when it has several)."""
  return result[index] if isinstance(result, tuple) else result
