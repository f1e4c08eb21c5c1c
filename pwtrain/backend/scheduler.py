"""An island's scheduler: one thread launching one queue of work in order, so that every device of
the island runs the computations of every program in the same order (gang scheduling;
backend/controller.py enqueues, the scheduler launches).

The queue is one order per island. Ordinary work joins at its end; a priority client's work may
be placed ahead of queued work that has not been taken yet (backend/policy.py says where), never
ahead of work already taken. Every item carries its place in that order (`Work.order`).

Published values. A node's outputs may be published when it launches (`Work.publishes`), and a
node may read, as an argument, the newest value published under a name on its island
(`program.Latest`), resolved when it launches. Both happen on the island's thread, in queue
order, so a reader placed between a program that donates a value and the one before it reads
the value before the donation: the controller's way of reading live training state in place.
"""

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
import weakref
from typing import Any

import jax

from pwtrain.backend.faults import IslandLost, is_device_loss, read_of_lost
from pwtrain.backend.policy import IslandClock
from pwtrain.backend.program import Latest, NotPublished
from pwtrain.backend.trace import Event, Trace

LAST = (float("inf"),)  # the place of the item that stops a scheduler: after everything


@dataclasses.dataclass(frozen=True)
class Work:
  """One item of an island's queue: `launch(*args)` (futures among `args` resolved first, and
  `program.Latest` args read from the island's published values), its result into `out`.
  `after`: a future to wait for before starting; `computes=False`: an offer or a pull of a
  transfer between processes (backend/pulls.py), or a publication, launched outside the CPU
  lock and not waited on. `order`: its place in the island's one order (policy.py);
  `priority`: a priority client's (its time is counted apart: IslandClock); `publishes`:
  (name, output index or None for the whole result) to publish when it launches."""

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


class OrderedQueue:
  """The island's queue: items sorted by `Work.order`; `put` appends (ordinary work comes in
  order), `insert` places an item at its order. Holding `lock`, a caller may read `taken` (the
  order of the last item handed to the scheduler) and insert consistently with it."""

  def __init__(self):
    self.lock = threading.Condition()
    self._items: list = []
    self.taken: tuple = ()

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
    """The next item (None: stop), waiting for one."""
    with self.lock:
      while not self._items:
        self.lock.wait()
      work = self._items.pop(0)
      if work is not None and work.order:
        self.taken = work.order
      return work

  def __len__(self) -> int:
    with self.lock:
      return len(self._items)


class IslandScheduler:
  """One thread, one queue of `Work`: launches the island's work strictly in queue order."""

  def __init__(self, name: str, trace: Trace | None, serial, lost_devices: dict | None = None):
    """`lost_devices`: {device: IslandLost} of the lost islands (the dispatcher's): a work whose
    input was deleted with one of them fails with its IslandLost."""
    self.name = name
    self.trace = trace
    self.serial = serial
    self.queue = OrderedQueue()
    # Set while the island is lost (backend/faults.py): every work fails with it, unlaunched.
    self.lost: IslandLost | None = None
    self.published: dict[str, Any] = {}  # name -> the newest value published here
    self.clock = IslandClock()  # its busy time, the priority client's apart (policy.py)
    self._lost_devices = {} if lost_devices is None else lost_devices
    self._made: dict[int, weakref.ref] = {}  # the arrays its work made that are alive
    self.thread = threading.Thread(target=self._loop, name=f"sched-{name}", daemon=True)
    self.thread.start()
    # Completion times: exact when serialized; otherwise a watcher thread waits on the outputs
    # (a lower bound for nodes whose outputs were all donated onwards before it looked). The
    # clock needs them too once priority work shares the island.
    record = trace is not None and trace.record_completion and serial is None
    self.watcher = CompletionWatcher(name) if record else None
    self._clock_watcher: CompletionWatcher | None = None
    self._last_done = 0.0

  def _loop(self):
    while True:
      work = self.queue.get()
      if work is None:
        return
      event = work.event
      if self.lost is not None:
        work.out.set_exception(self.lost)
        continue
      if work.after is not None:  # see Controller._dispatch_local
        concurrent.futures.wait([work.after])
      values = []
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
          if self.watcher:
            self.watcher.watch(result, stamp(event, self.trace))
          self._count_async(result, work.priority, launched)
        else:
          # Inputs pulled from another process are awaited before the lock is taken: the
          # computation that sends them may wait on one of this process's (no cycle of waits).
          _block_ready(values)
          with self.serial:  # see Controller: run to completion, one computation at a time
            launched = time.perf_counter()
            if event is not None:
              event.launch = self.trace.now()
            with jax.profiler.TraceAnnotation(work.name):
              result = work.launch(*values)
              _block_ready(result)
            if event is not None:  # exact: nothing else runs until this has finished
              event.done = self.trace.now()
            self.clock.add(work.priority, time.perf_counter() - launched)
        for name, index in work.publishes:  # before the next work is taken: see the module doc
          self.published[name] = result if index is None else _output(result, index)
      except BaseException as e:  # noqa: BLE001 - forwarded to whoever waits on the future
        if is_device_loss(e):  # this island's devices are gone: every node of it is lost
          self.lost = IslandLost(self.name, str(e).splitlines()[0])
          e = self.lost
        elif self._lost_devices:  # it read an array that a lost island took with it
          e = read_of_lost(values, self._lost_devices) or e
        work.out.set_exception(e)
        continue
      self._remember(result)
      if self.lost is not None and work.computes:  # lost while it ran: its outputs go too
        self.delete_made()
        work.out.set_exception(self.lost)
        continue
      work.out.set_result(result)
      del values, result  # held no longer than the work: a published value's old copy goes

  def _value(self, arg):
    if isinstance(arg, concurrent.futures.Future):
      return arg.result()
    if isinstance(arg, Latest):
      if arg.name not in self.published:
        raise NotPublished(f"nothing is published as {arg.name!r} on {self.name} yet")
      value = self.published[arg.name]
      return {k: value[k] for k in arg.keys} if arg.keys else value
    return arg

  def _count_async(self, result, priority: bool, launched: float) -> None:
    """Unserialized (accelerators): the clock's busy time from when outputs become ready, once
    priority work runs here (each item from its launch or its predecessor's end, whichever is
    later: one queue runs in order). Ordinary work alone is not watched."""
    if self._clock_watcher is None:
      if not priority:
        return
      self._clock_watcher = CompletionWatcher(f"{self.name}-clock")

    def done(now: float) -> None:
      self.clock.add(priority, max(now - max(launched, self._last_done), 0.0))
      self._last_done = now

    self._clock_watcher.watch(result, lambda: done(time.perf_counter()))

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
    for watcher in (self.watcher, self._clock_watcher):
      if watcher:
        watcher.stop()


def _output(result, index: int):
  """Output `index` of a node's result (a tuple when it has several)."""
  return result[index] if isinstance(result, tuple) else result


def _order(work) -> tuple:
  """A queued item's place in the order; the stop (None) is after everything."""
  return LAST if work is None else work.order


def stamp(event, trace):
  """A completion callback that stamps `event`'s end on `trace`'s clock."""

  def done():
    event.done = trace.now()

  return done


class CompletionWatcher:
  """Waits for results in launch order and calls each one's callback once it is ready."""

  def __init__(self, name):
    self.queue: queue.Queue = queue.Queue()
    self.thread = threading.Thread(target=self._loop, name=f"watch-{name}", daemon=True)
    self.thread.start()

  def watch(self, value, callback):
    self.queue.put((value, callback))

  def _loop(self):
    while True:
      item = self.queue.get()
      if item is None:
        return
      value, callback = item
      _block_ready(value)
      callback()

  def stop(self):
    self.queue.put(None)
    self.thread.join()


def _block_ready(value) -> None:
  """Waits for a node's outputs, for the trace; outputs already donated onwards are skipped,
  and so are those with no data on this process (distributed mode)."""
  for x in jax.tree.leaves(value):
    try:
      jax.block_until_ready(here_only(x))
    except RuntimeError:  # JaxRuntimeError too
      pass  # donated to a successor: its completion is stamped on the successor's event


def here_only(value) -> list:
  """The leaves of `value` with data on this process (in distributed mode, another process's
  node leaves arrays without any here; waiting on them would wait forever)."""
  return [x for x in jax.tree.leaves(value) if not isinstance(x, jax.Array) or x.addressable_shards]
