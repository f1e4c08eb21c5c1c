"""An island worker's values (server.py): futures keyed by handle, each dropped after its
announced number of reads, or pinned until released."""

import concurrent.futures
import threading

# How long an operation waits for a handle that has not been announced yet (its Put or the
# Enqueue that produces it may still be on the way).
LOOKUP_TIMEOUT_S = 600.0


class Store:
  """Futures of values by handle, each dropped after its announced number of reads."""

  def __init__(self):
    self._entries: dict[str, list] = {}  # handle -> [future, uses left (0: pinned)]
    self._cond = threading.Condition()
    self._generation = 0  # bumped by reset: lookups waiting for the old session give up

  def create(self, handle: str, uses: int) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if uses < 0:  # nobody reads it
      return future
    with self._cond:
      if handle in self._entries:
        raise ValueError(f"handle {handle!r} already exists")
      self._entries[handle] = [future, uses]
      self._cond.notify_all()
    return future

  def lookup(self, handle: str, timeout: float = LOOKUP_TIMEOUT_S) -> concurrent.futures.Future:
    with self._cond:
      generation = self._generation
      self._cond.wait_for(
        lambda: handle in self._entries or self._generation != generation, timeout
      )
      if handle not in self._entries:
        raise KeyError(f"no value {handle!r} on this worker (released, reset or never produced)")
      return self._entries[handle][0]

  def read(self, handle: str) -> None:
    """One announced read done: drops the value after its last."""
    with self._cond:
      entry = self._entries.get(handle)
      if entry is not None and entry[1] > 0:
        entry[1] -= 1
        if entry[1] == 0:
          del self._entries[handle]

  def release(self, handle: str) -> None:
    with self._cond:
      self._entries.pop(handle, None)

  def reset(self) -> None:
    with self._cond:
      for future, _ in self._entries.values():
        if not future.done():
          future.set_exception(RuntimeError("the worker was reset"))
      self._entries.clear()
      self._generation += 1
      self._cond.notify_all()

  def __len__(self) -> int:
    return len(self._entries)
