"""The island schedulers' policy: where a priority client's program joins each island's one order,
and how much of an island's time that client may take.

Every island keeps one order of work (backend/scheduler.py), and every program's work joins it
at one place, the same on every island the program touches, so that all islands see the
programs in one global order and no two islands run two programs' collectives in opposite
orders (gang scheduling).

  ordinary   a program joins the end of every island's queue, in dispatch order.
  priority   a program (Controller.run(priority=True); serving's prefill and decode) joins right
             after the latest program that any of its islands has begun (taken work of), or
             after the client's previous priority program if that is later: ahead of every
             program queued behind that place on all of its islands, never ahead of work an
             island has already taken. A one-island program thus waits at most for the work
             running there; a program over several islands waits, on each, for whatever the
             most advanced of them has begun.
  share      while the priority work's share of an island's recent busy time is at least
             `share` on any island the program touches, the program joins at the end instead,
             as an ordinary one. Under saturating load the priority client gets about `share`
             of each island's time and the others the rest, so a flood of priority work slows
             the others by a known fraction and never starves them; an island with nothing else
             queued runs priority work at once either way. Recent: busy time decayed
             exponentially with a time constant of `WINDOW_S` seconds.

A priority program may read only its inputs, published values (program.Latest) and its own
client's earlier outputs: an output of a program it passes would be computed after it.
"""

import contextlib
import dataclasses
import math
import threading
import time

WINDOW_S = 10.0  # the time constant over which an island's recent busy time is counted


class IslandClock:
  """An island's busy time: totals since the start, and the recent (decayed) sums the share is
  judged by, the priority client's apart from everyone else's."""

  def __init__(self, window_s: float = WINDOW_S):
    self.window_s = window_s
    self._lock = threading.Lock()
    self._total = {False: 0.0, True: 0.0}
    self._recent = {False: 0.0, True: 0.0}
    self._at = time.perf_counter()

  def add(self, priority: bool, seconds: float) -> None:
    with self._lock:
      self._decay()
      self._recent[priority] += seconds
      self._total[priority] += seconds

  def share(self) -> float:
    """The priority client's share of the island's recent busy time (0 when idle)."""
    with self._lock:
      self._decay()
      busy = self._recent[False] + self._recent[True]
      return self._recent[True] / busy if busy > 0 else 0.0

  def totals(self) -> dict[str, float]:
    """{"priority", "ordinary"}: busy seconds since the start."""
    with self._lock:
      return {"priority": self._total[True], "ordinary": self._total[False]}

  def _decay(self) -> None:
    now = time.perf_counter()
    factor = math.exp(-(now - self._at) / self.window_s)
    self._at = now
    for key in self._recent:
      self._recent[key] *= factor


class PriorityPolicy:
  """Places priority programs (see the module doc). `share` in (0, 1]: 1 lets priority work
  always go ahead."""

  def __init__(self, share: float = 0.2):
    self.share = share
    self._last: tuple = ()  # the place of the priority client's previous program
    self._count = 0

  def place(self, schedulers, number: int) -> tuple:
    """The place of priority program `number` (its dispatch number) on `schedulers`, the
    islands it touches, whose queue locks the caller holds: an order prefix that each of its
    works extends with its index. Ordinary work of program n has order (n, 0, index)."""
    if any(s.clock.share() >= self.share for s in schedulers):
      place = (number, 0)  # at the end, as an ordinary program
    else:
      begun = [s.queue.taken[0] for s in schedulers if s.queue.taken]
      after = max([*begun, *self._last[:1]], default=-1)
      self._count += 1
      place = (after, 1, self._count)
    self._last = place
    return place

  def insert(self, placed: list, number: int) -> None:
    """Inserts priority program `number`'s work, [(scheduler, Work)] in dispatch order, at its
    place on every island it touches, their queues locked meanwhile (in name order: no lock
    cycles with another inserter; a scheduler takes its own lock only)."""
    schedulers = sorted({s.name: s for s, _ in placed}.values(), key=lambda s: s.name)
    with contextlib.ExitStack() as held:
      for scheduler in schedulers:
        held.enter_context(scheduler.queue.lock)
      place = self.place(schedulers, number)
      for index, (scheduler, work) in enumerate(placed):
        scheduler.queue.insert(dataclasses.replace(work, order=(*place, index), priority=True))
