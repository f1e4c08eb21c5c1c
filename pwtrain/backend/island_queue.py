"""An island's queue (backend/scheduler.py runs it): `Work` items in one order (policy.py), and
the launch window that bounds how many of them are launched and not finished (the scheduler's
module doc gives the rules: the window, ordinary work's window of 1 while priority work is
about, transfers onto the island outside it)."""

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any

from pwtrain.backend.trace import Event

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


def _windowed(work) -> bool:
  """Whether `work` counts in the launch window: a computation, not a transfer of its program's
  inputs onto the island (which waits on no work: Work.begins)."""
  return work.computes and work.begins


def _order(work) -> tuple:
  """A queued item's place in the order; the stop (None) is after everything."""
  return LAST if work is None else work.order
