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
  share      a priority program goes ahead only while the priority client is within its share
             on every island it touches; otherwise it joins at the end, as an ordinary one. Each
             island keeps a balance (IslandClock): ordinary work run there earns the priority
             client share / (1 - share) of its seconds, priority work run there spends its own,
             and priority work may go ahead while the balance is positive. Under saturating
             load the priority client so gets `share` of each island's time and the others the
             rest: a flood of priority work slows them by that fraction and never starves them.
             The balance is held within one ordinary item's earning either way (the longest of
             the last few), so neither an idle spell nor a burst carries over; before any
             ordinary work has run on an island, priority work goes ahead there, and an island
             with nothing else queued runs priority work at once either way.

A priority program may read only its inputs, published values (program.Latest) and its own
client's earlier outputs: an output of a program it passes would be computed after it.
"""

import collections
import contextlib
import dataclasses
import threading

RECENT = 8  # ordinary items whose longest bounds an island's balance


class IslandClock:
  """An island's busy time: totals since the start, the priority client's apart from everyone
  else's, and the priority client's balance of time it may still take ahead (module doc)."""

  def __init__(self, share: float = 0.2):
    self.share = share
    self._lock = threading.Lock()
    self._total = {False: 0.0, True: 0.0}
    self._balance = 0.0  # seconds of priority work that may still go ahead
    self._recent: collections.deque = collections.deque(maxlen=RECENT)

  def add(self, priority: bool, seconds: float) -> None:
    with self._lock:
      self._total[priority] += seconds
      if priority:
        self._balance -= seconds
      else:
        self._recent.append(seconds)
        self._balance += seconds * self._rate()
      bound = max(self._recent, default=0.0) * self._rate()
      self._balance = min(max(self._balance, -bound), bound)

  def may_go_ahead(self) -> bool:
    """Whether the priority client is within its share here: its balance is positive, or no
    ordinary work has run here yet."""
    with self._lock:
      return self.share >= 1 or not self._recent or self._balance > 0

  def totals(self) -> dict[str, float]:
    """{"priority", "ordinary"}: busy seconds since the start."""
    with self._lock:
      return {"priority": self._total[True], "ordinary": self._total[False]}

  def _rate(self) -> float:
    """Priority seconds earned per ordinary second."""
    return self.share / (1 - self.share) if self.share < 1 else float("inf")


class PriorityPolicy:
  """Places priority programs (see the module doc). `share` in (0, 1]: 1 lets priority work
  always go ahead; the islands' clocks keep the balances (`set_share` sets theirs)."""

  def __init__(self, share: float = 0.2):
    self.share = share
    self._last: tuple = ()  # the place of the priority client's previous program
    self._count = 0

  def set_share(self, share: float, schedulers) -> None:
    self.share = share
    for scheduler in schedulers:
      scheduler.clock.share = share

  def place(self, schedulers, number: int) -> tuple:
    """The place of priority program `number` (its dispatch number) on `schedulers`, the
    islands it touches, whose queue locks the caller holds: an order prefix that each of its
    works extends with its index. Ordinary work of program n has order (n, 0, index)."""
    if not all(s.clock.may_go_ahead() for s in schedulers):
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
