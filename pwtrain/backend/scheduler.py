"""An island's scheduler: one thread draining one FIFO queue, so that every device of the island
runs the computations of every program in the same order (gang scheduling; backend/controller.py
enqueues, the scheduler launches).
"""

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import weakref
from typing import Any

import jax

from pwtrain.backend.faults import IslandLost, is_device_loss, read_of_lost
from pwtrain.backend.trace import Event, Trace


@dataclasses.dataclass(frozen=True)
class Work:
  """One item of an island's queue: `launch(*args)` (futures among `args` resolved first), its
  result into `out`. `after`: a future to wait for before starting; `computes=False`: an offer or
  a pull of a transfer between processes (backend/pulls.py), launched outside the CPU lock and
  not waited on."""

  name: str
  launch: Any
  args: list
  out: concurrent.futures.Future
  event: Event | None = None
  after: concurrent.futures.Future | None = None
  computes: bool = True


class IslandScheduler:
  """One thread, one queue of `Work`: launches the island's work strictly in enqueue order."""

  def __init__(self, name: str, trace: Trace | None, serial, lost_devices: dict | None = None):
    """`lost_devices`: {device: IslandLost} of the lost islands (the dispatcher's): a work whose
    input was deleted with one of them fails with its IslandLost."""
    self.name = name
    self.trace = trace
    self.serial = serial
    self.queue: queue.Queue = queue.Queue()
    # Set while the island is lost (backend/faults.py): every work fails with it, unlaunched.
    self.lost: IslandLost | None = None
    self._lost_devices = {} if lost_devices is None else lost_devices
    self._made: dict[int, weakref.ref] = {}  # the arrays its work made that are alive
    self.thread = threading.Thread(target=self._loop, name=f"sched-{name}", daemon=True)
    self.thread.start()
    # Completion times: exact when serialized; otherwise a watcher thread waits on the outputs
    # (a lower bound for nodes whose outputs were all donated onwards before it looked).
    record = trace is not None and trace.record_completion and serial is None
    self.watcher = CompletionWatcher(name) if record else None

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
        values = [a.result() if isinstance(a, concurrent.futures.Future) else a for a in work.args]
        if not work.computes:  # an offer or a pull between processes: returns at once, no lock
          if event is not None:
            event.launch = self.trace.now()
          result = work.launch(*values)
          if event is not None:
            event.done = self.trace.now()
        elif self.serial is None:
          if event is not None:
            event.launch = self.trace.now()
          with jax.profiler.TraceAnnotation(work.name):  # the node's name in a profiler trace
            result = work.launch(*values)
          if self.watcher:
            self.watcher.watch(result, event, self.trace)
        else:
          # Inputs pulled from another process are awaited before the lock is taken: the
          # computation that sends them may wait on one of this process's (no cycle of waits).
          _block_ready(values)
          with self.serial:  # see Controller: run to completion, one computation at a time
            if event is not None:
              event.launch = self.trace.now()
            with jax.profiler.TraceAnnotation(work.name):
              result = work.launch(*values)
              _block_ready(result)
            if event is not None:  # exact: nothing else runs until this has finished
              event.done = self.trace.now()
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
    self.queue.put(None)
    self.thread.join()
    if self.watcher:
      self.watcher.stop()


class CompletionWatcher:
  """Waits for results in launch order and stamps completion times (tracing only)."""

  def __init__(self, name):
    self.queue: queue.Queue = queue.Queue()
    self.thread = threading.Thread(target=self._loop, name=f"watch-{name}", daemon=True)
    self.thread.start()

  def watch(self, value, event, trace):
    self.queue.put((value, event, trace))

  def _loop(self):
    while True:
      item = self.queue.get()
      if item is None:
        return
      value, event, trace = item
      _block_ready(value)
      event.done = trace.now()

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
