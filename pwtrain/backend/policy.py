"""The island schedulers' policy: where a priority client's program joins each island's one order,
and how much of an island's time that client may take.

Every island keeps one order of work (backend/scheduler.py), and every program's work joins it
at one place, the same on every island the program touches, so that all islands see the
programs in one global order and no two islands run two programs' collectives in opposite
orders (gang scheduling).

  ordinary   a program joins the end of every island's queue, in dispatch order.
  priority   a program (Controller.run(priority=True); serving's prefill and decode) joins right
             after the latest program that any of its islands has begun (taken work of, other
             than a transfer of the program's inputs: scheduler.Work.begins), or
             after the client's previous priority program if that is later: ahead of every
             program queued behind that place on all of its islands, never ahead of work an
             island has already taken. A one-island program thus waits at most for the work
             running there; a program over several islands waits, on each, for whatever the
             most advanced of them has begun.
  share      a priority program goes ahead only while the priority client is within its share
             on every island it touches; otherwise it is held back, in the client's order, until
             it is (or until every island it touches is empty: nothing queued or running), and
             then placed as above. Each island keeps a balance (IslandClock): ordinary work run
             there earns the priority client share / (1 - share) of its seconds, priority work
             run there spends its own, and priority work placed there and not yet finished is
             counted against it at the seconds its node took last time (so several programs in
             flight cannot all go on one positive balance). A priority program is placed while
             the balance less what is in flight is positive. Under saturating load the priority
             client so gets `share` of each island's time and the others the rest: a flood of
             priority work slows them by that fraction and never starves them. The balance is
             held within the earning of one ordinary item (the longest of the last few) per
             item of the island's launch window (a priority program placed waits behind up to
             that many launched items, whose earning would otherwise be lost), a debt within
             that or one priority item's cost (so that every item is charged in full), so
             neither an idle spell nor a burst carries over. Before any ordinary work has run
             on an island, priority work goes ahead there; so it does on an empty island, one
             program at a time (a client that leaves the island empty now and then so gains
             one program per gap, charged in full), and on a lost one, where it fails at once.

A priority program may read only its inputs, published values (program.Latest) and its own
client's earlier outputs: an output of a program it passes would be computed after it.
"""

import collections
import contextlib
import dataclasses
import threading

RECENT = 8  # items of each client whose longest bound an island's balance


class IslandClock:
  """An island's busy time: totals since the start, the priority client's apart from everyone
  else's, and the priority client's balance of time it may still take ahead (module doc)."""

  def __init__(self, share: float = 0.2, window: int = 1):
    """`window`: the island's launch window (0: none, taken as 1), which bounds the credit."""
    self.share = share
    self.window = window
    self._lock = threading.Lock()
    self._total = {False: 0.0, True: 0.0}
    self._balance = 0.0  # seconds of priority work that may still go ahead
    self._recent: collections.deque = collections.deque(maxlen=RECENT)  # ordinary items' seconds
    self._recent_priority: collections.deque = collections.deque(maxlen=RECENT)
    self._pending = 0.0  # reserved seconds of priority work placed here and not finished
    self._last: dict[str, float] = {}  # a priority node's name -> the seconds it took last

  def reserve(self, name: str) -> float:
    """Counts priority node `name`, placed here, against the balance until it finishes: the
    seconds it took last time (0 the first time); `add` or `release` gives them back."""
    with self._lock:
      reserved = self._last.get(name, 0.0)
      self._pending += reserved
      return reserved

  def release(self, reserved: float) -> None:
    """A placed priority node failed or never ran: its reservation goes."""
    with self._lock:
      self._pending = max(self._pending - reserved, 0.0)

  def add(self, priority: bool, seconds: float, work=None) -> None:
    """`seconds` of busy time; `work` (scheduler.Work), the item that ran: its reservation
    goes, and a priority node's time is what the next of its name reserves."""
    with self._lock:
      self._total[priority] += seconds
      if work is not None:
        self._pending = max(self._pending - work.reserved, 0.0)
        if priority:
          self._last[work.name] = seconds
      if priority:
        self._balance -= seconds
        self._recent_priority.append(seconds)
      else:
        self._recent.append(seconds)
        self._balance += seconds * self._rate()
      # Credit up to one ordinary item's earning per item of the launch window; debt up to that
      # or one priority item's cost, whichever is more, so that each is charged in full.
      bound = max(self._recent, default=0.0) * self._rate() * max(self.window, 1)
      debt = max(bound, max(self._recent_priority, default=0.0))
      self._balance = min(max(self._balance, -debt), bound)

  def may_go_ahead(self) -> bool:
    """Whether the priority client is within its share here: its balance less its work in
    flight is positive, or no ordinary work has run here yet."""
    with self._lock:
      return self.share >= 1 or not self._recent or self._balance - self._pending > 0

  def totals(self) -> dict[str, float]:
    """{"priority", "ordinary"}: busy seconds since the start."""
    with self._lock:
      return {"priority": self._total[True], "ordinary": self._total[False]}

  def _rate(self) -> float:
    """Priority seconds earned per ordinary second."""
    return self.share / (1 - self.share) if self.share < 1 else float("inf")


class PriorityPolicy:
  """Places priority programs (see the module doc). `share` in (0, 1]: 1 lets priority work
  always go ahead; the islands' clocks keep the balances (`set_share` sets theirs). Programs held
  back for their share are placed by `place_held`, which each scheduler calls as its work
  finishes (IslandScheduler.progress)."""

  def __init__(self, share: float = 0.2):
    self.share = share
    self._last: tuple = ()  # the place of the priority client's previous program
    self._count = 0
    self._lock = threading.Lock()  # taken before any queue lock
    self._held: collections.deque = collections.deque()  # programs' [(scheduler, Work)], in order

  def set_share(self, share: float, schedulers) -> None:
    self.share = share
    for scheduler in schedulers:
      scheduler.clock.share = share

  def place(self, schedulers) -> tuple:
    """The place of a priority program on `schedulers`, the islands it touches, whose queue
    locks the caller holds: an order prefix that each of its works extends with its index.
    Ordinary work of program n has order (n, 0, index)."""
    begun = [s.queue.taken[0] for s in schedulers if s.queue.taken]
    after = max([*begun, *self._last[:1]], default=-1)
    self._count += 1
    self._last = (after, 1, self._count)
    return self._last

  def insert(self, placed: list, number: int) -> None:
    """Places priority program `number`'s work, [(scheduler, Work)] in dispatch order, on every
    island it touches, now if the share allows it there, else once it does (`place_held`)."""
    with self._lock:
      self._held.append(placed)
      self._place_held(everything=False)

  def place_held(self, everything: bool = False) -> None:
    """Places the held programs that the share now allows, in order (`everything`: all of
    them, as when the islands stop)."""
    if self._held:  # read without the lock: `insert` looks itself after it appends
      with self._lock:
        self._place_held(everything)

  def _place_held(self, everything: bool) -> None:
    while self._held:
      placed = self._held[0]
      # Queues locked in name order: no lock cycles with another inserter; a scheduler takes
      # its own lock only.
      schedulers = sorted({s.name: s for s, _ in placed}.values(), key=lambda s: s.name)
      with contextlib.ExitStack() as held:
        for scheduler in schedulers:
          held.enter_context(scheduler.queue.lock)
        if not (everything or all(_may_place(s) for s in schedulers)):
          return
        place = self.place(schedulers)
        for index, (scheduler, work) in enumerate(placed):
          reserved = scheduler.clock.reserve(work.name)
          scheduler.queue.insert(
            dataclasses.replace(work, order=(*place, index), priority=True, reserved=reserved)
          )
      self._held.popleft()


def _may_place(scheduler) -> bool:
  """Whether a priority program may be placed on `scheduler`'s island now (its queue locked)."""
  return scheduler.lost is not None or scheduler.queue.idle() or scheduler.clock.may_go_ahead()
