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

Published values. A node's outputs may be published when it launches (`Work.publishes`), and a
node may read, as an argument, the newest value published under a name on its island
(`program.Latest`), resolved when it launches. Both happen on the island's thread, in queue
order, so a reader placed between a program that donates a value and the one before it reads
the value before the donation: the controller's way of reading live training state in place.
"""

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import weakref
from typing import Any

import jax

from pwtrain.backend.completion import CompletionWatcher, block_ready
from pwtrain.backend.completion import here_only as here_only  # backend.scheduler.here_only
from pwtrain.backend.faults import IslandLost, is_device_loss, read_of_lost
from pwtrain.backend.policy import IslandClock
from pwtrain.backend.program import Latest, NotPublished
from pwtrain.backend.trace import Event, Trace

# Computations an island may have launched and not finished where execution is not serialized
# (the module doc): chosen by experiments/bench_window.py (docs/benchmarks.md).
DEFAULT_LAUNCH_WINDOW = 2
LAST = (float("inf"),)  # the place of the item that stops a scheduler: after everything


@dataclasses.dataclass(frozen=True)
class Work:
  """One item of an island's queue: `launch(*args)` (futures among `args` resolved first, and
  `program.Latest` args read from the island's published values), its result into `out`.
  `after`: a future to wait for before starting; `computes=False`: an offer or a pull of a
  transfer between processes (backend/pulls.py), or a publication, launched outside the CPU
  lock and the launch window, and not waited on. `order`: its place in the island's one order
  (policy.py); `priority`: a priority client's (its time is counted apart: IslandClock), and
  `reserved` the seconds it is expected to take, counted against that client's share until it
  finishes; `publishes`: (name, output index or None for the whole result) to publish when it
  launches. `begins=False`: a transfer of one of its program's inputs onto the island (a step's
  batch), which reads no node of the program: taking it does not begin the program (`taken`),
  so a priority program may still be placed ahead of the program's other work."""

  name: str
  launch: Any
  args: list
  out: concurrent.futures.Future
  event: Event | None = None
  after: concurrent.futures.Future | None = None
  computes: bool = True
  order: tuple = ()
  priority: bool = False
  publishes: tuple = ()
  begins: bool = True
  reserved: float = 0.0


class OrderedQueue:
  """The island's queue: items sorted by `Work.order`; `put` appends (ordinary work comes in
  order), `insert` places an item at its order. Holding `lock`, a caller may read `taken` (the
  order of the last item handed to the scheduler that begins its program: `Work.begins`) and
  `idle`, and insert consistently with them.

  `window` (0: no bound): computing items are handed out only while fewer than that many are
  in flight (handed out and not yet `finished`); items that do not begin their program
  (`Work.begins`) are outside the window."""

  def __init__(self, window: int = 0):
    self.lock = threading.Condition()
    self._items: list = []
    self.taken: tuple = ()
    self.window = window
    self.in_flight = {False: 0, True: 0}  # windowed items handed out, not finished, by priority
    self._started: dict[int, float] = {}  # id(ordinary item in flight) -> when it was handed out
    self._ordinary_s = 0.0  # how long the last ordinary item took, from hand-out to its end
    self._priority_end = -float("inf")  # when the last priority item finished

  def put(self, work) -> None:
    with self.lock:
      self._items.append(work)
      self.lock.notify()

  def insert(self, work) -> None:
    """Places `work` before the first queued item of a later order (call with `lock` held)."""
    assert work.order > self.taken, (work.order, self.taken)
    index = next((i for i, w in enumerate(self._items) if _order(w) > work.order), None)
    self._items.insert(len(self._items) if index is None else index, work)
    self.lock.notify()

  def get(self):
    """The next item (None: stop), waiting for one, and for room in the window if it computes."""
    with self.lock:
      while not self._items or not self._room_for(self._items[0]):
        self.lock.wait(self._quiet_in())
      work = self._items.pop(0)
      if work is not None:
        if work.order and work.begins:
          self.taken = work.order
        if _windowed(work):
          self.in_flight[work.priority] += 1
          if not work.priority:
            self._started[id(work)] = time.monotonic()
      return work

  def _room_for(self, work) -> bool:
    if work is None or not _windowed(work) or not self.window:
      return True
    window = self.window if work.priority or not self._priority_about() else 1
    return sum(self.in_flight.values()) < window

  def _priority_about(self) -> bool:
    """Whether priority work is queued, in flight, or finished within the quiet time."""
    return (
      self.in_flight[True] > 0
      or self._quiet_in() is not None
      or any(w is not None and w.priority for w in self._items)
    )

  def _quiet_in(self) -> float | None:
    """Seconds until priority work has been quiet for the last ordinary item's time (None: it
    has, or no window applies: wait for a notify)."""
    left = self._priority_end + self._ordinary_s - time.monotonic()
    return left if self.window > 1 and left > 0 else None

  def set_window(self, window: int) -> None:
    with self.lock:
      self.window = window
      self.lock.notify()

  def finished(self, work) -> None:
    """A computing item handed out has finished (or failed, or was never launched)."""
    with self.lock:
      if _windowed(work):
        self.in_flight[work.priority] -= 1
      now = time.monotonic()
      if work.priority:
        self._priority_end = now
      elif id(work) in self._started:
        self._ordinary_s = now - self._started.pop(id(work))
      self.lock.notify()

  def idle(self) -> bool:
    """Whether nothing is queued or in flight here (call with `lock` held)."""
    return not any(self.in_flight.values()) and all(w is None for w in self._items)

  def __len__(self) -> int:
    with self.lock:
      return len(self._items)


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
  ):
    """`lost_devices`: {device: IslandLost} of the lost islands (the dispatcher's): a work whose
    input was deleted with one of them fails with its IslandLost. `launch_window`: see the
    module doc (serialized execution needs none: each item runs to completion). `progress`:
    called with no lock held whenever an item has finished (the policy places held work)."""
    self.name = name
    self.trace = trace
    self.serial = serial
    self.queue = OrderedQueue(launch_window if serial is None else 0)
    # Set while the island is lost (backend/faults.py): every work fails with it, unlaunched.
    self.lost: IslandLost | None = None
    self.published: dict[str, Any] = {}  # name -> the newest value published here
    self.clock = IslandClock(window=self.queue.window)  # its busy time, priority's apart
    self.progress = progress
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
      now = time.perf_counter()
      self.clock.add(work.priority, max(now - max(launched, self._last_done), 0.0), work)
      self._last_done = now
      if event is not None:
        event.done = self.trace.now()

    return ready

  def _finished_callback(self, work: Work):
    def finished() -> None:
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


def _output(result, index: int):
  """Output `index` of a node's result (a tuple when it has several)."""
  return result[index] if isinstance(result, tuple) else result


def _windowed(work) -> bool:
  """Whether `work` counts in the launch window: a computation, not a transfer of its program's
  inputs onto the island (which waits on no work: Work.begins)."""
  return work.computes and work.begins


def _order(work) -> tuple:
  """A queued item's place in the order; the stop (None) is after everything."""
  return LAST if work is None else work.order
