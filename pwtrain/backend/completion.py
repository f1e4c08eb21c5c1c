"""When launched work finishes on the device: a watcher thread that waits for each launched
result's outputs, in launch order (backend/scheduler.py: the launch window, the islands' clocks
and the trace's completion times all read it).
"""

import queue
import threading

import jax


def stamp(event, trace):
  """A completion callback that stamps `event`'s end on `trace`'s clock."""

  def done():
    event.done = trace.now()

  return done


class CompletionWatcher:
  """Waits for launched results in launch order: `watch(value, ready, finished)` calls
  `ready()` once `value`'s outputs are ready, then `finished()`.

  An item whose outputs were all donated onwards before the watcher looked (a train step's state
  to the next step) has nothing left to wait on: `ready` is called at once (a lower bound), and
  `finished` with the next item whose outputs it can wait on (a donation's reader runs after
  it), or after `DEFERRED_S` with none (its outputs deleted otherwise: a lost island's).
  `on_error(e)`: an item's computation failed (its outputs raise `e`)."""

  def __init__(self, name, on_error=None):
    self.queue: queue.Queue = queue.Queue()
    self._on_error = on_error
    self.thread = threading.Thread(target=self._loop, name=f"watch-{name}", daemon=True)
    self.thread.start()

  def watch(self, value, ready, finished=None):
    self.queue.put((value, ready, finished))

  def _loop(self):
    deferred: list = []  # `finished` of items with nothing left to wait on
    while True:
      try:
        item = self.queue.get(timeout=DEFERRED_S if deferred else None)
      except queue.Empty:
        item = ()
      if not item:  # nothing more launched, or stop: the deferred are finished
        for finished in deferred:
          finished()
        deferred.clear()
        if item is None:
          return
        continue
      value, ready, finished = item
      try:
        waited = block_ready(value)
      except Exception as e:  # noqa: BLE001 - the computation's error is its owner's to read
        waited = True
        if self._on_error is not None:
          self._on_error(e)
      ready()
      if finished is not None:
        deferred.append(finished)
      if waited:
        for finished in deferred:
          finished()
        deferred.clear()

  def stop(self):
    self.queue.put(None)
    self.thread.join()


DEFERRED_S = 0.5  # CompletionWatcher: how long a finished item waits for a successor to wait on


def block_ready(value) -> bool:
  """Waits for a node's outputs; outputs already donated onwards (deleted) are skipped, and so
  are those with no data on this process (distributed mode). Whether it had something to wait
  on (False: every array of `value` was deleted). Any other error (the computation's, a device
  loss) is raised."""
  deleted = waited = 0
  for x in here_only(value):
    if isinstance(x, jax.Array) and x.is_deleted():
      deleted += 1
      continue
    try:
      jax.block_until_ready(x)
      waited += 1
    except jax.errors.JaxRuntimeError:
      if not (isinstance(x, jax.Array) and x.is_deleted()):  # donated while it waited
        raise
      deleted += 1
  return waited > 0 or not deleted


def here_only(value) -> list:
  """The leaves of `value` with data on this process (in distributed mode, another process's
  node leaves arrays without any here; waiting on them would wait forever)."""
  return [x for x in jax.tree.leaves(value) if not isinstance(x, jax.Array) or x.addressable_shards]
