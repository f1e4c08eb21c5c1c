"""A worker's execution queue (server.py): one order of operations, taken in turn by its one
thread, with a priority client's operations placed ahead of queued ordinary ones.

Every item has a place in the order, `(program, kind, arrival)`, `program` the controller's
number of the program (Controller.run numbers every program it sends):

  ordinary   the operations of an Enqueue (a program's, a save's, the releases it carries; a
             Release call's too) join the end, in arrival order: a program's as (program, 0),
             the others after the priority work placed after the latest program, (program, 2).
             The controller sends programs one at a time, so every worker sees the programs it
             shares in dispatch order.
  priority   the operations of a priority Enqueue (Controller.run(priority=True): serving),
             (program, 1), join right after the latest of: the program the worker has begun,
             the previous priority operations (which so keep their order), and the queued
             item that makes a value they read (a reader placed ahead of its value's maker
             would wait for it forever). They go ahead of every queued item of a later
             program, never ahead of an item already taken. A published value they read
             (`@name=`, program.Latest) is the newest one published by the work run before
             them, as on an embedded island; only while nothing is published under the name
             do they wait for the value the controller named. The releases a priority Enqueue
             carries are ordinary: a value released is dropped after every queued reader.
             At most AHEAD priority executes run in a row while an ordinary program waits:
             a priority operation that would be the next past that goes after the next queued
             program instead, so that a flood of serving slows training and never stops it
             (remote workers keep no share, backend/policy.py's).

A priority program over several workers must go after the same program on all of them, which
no worker alone knows: it is placed in two phases (remote/sending.py). `offer` holds its items
and the queue (no item of a program later than the latest the items may follow here is taken)
and answers that program; `place`, given the latest answer of all the workers, queues them after
it. Two workers so never run two programs in opposite orders.
"""

import re
import threading

AHEAD = 4  # priority executes in a row while an ordinary program waits (the module doc)

# An Execute argument (protocol.proto): `@<name>=` (the newest published as `name`, else what
# follows), a handle, `#i,j,...` (leaves of it).
_ARG = re.compile(r"(?:@(?P<name>[^=]*)=)?(?P<handle>.+?)(?:#(?P<leaves>\d+(?:,\d+)*))?")


def parse_arg(arg: str) -> tuple:
  """An Execute argument's (published name or None, handle, leaf indices or None)."""
  m = _ARG.fullmatch(arg)
  leaves = None if m["leaves"] is None else [int(i) for i in m["leaves"].split(",")]
  return m["name"], m["handle"], leaves


class OpQueue:
  """Items `(op, outs)` (server.py's; `op` None: a release) in the order the module doc gives."""

  def __init__(self, published: dict):
    """`published`: the worker's {name: handle} (what `@name=` arguments read)."""
    self._published = published
    self._cond = threading.Condition()
    self._items: list = []  # [(order, item)], sorted by order
    self._makers: dict[str, tuple] = {}  # handle -> the order of the queued item making it
    self._program = 0  # the latest program number an ordinary request carried
    self._arrivals = 0
    self._taken: tuple = (0, 0, 0)  # the order of the latest item taken
    self._last_priority: tuple = (0, 0, 0)
    self._ahead = 0  # priority executes taken since the last ordinary program's item
    self._offered: list | None = None  # an offered program's items, until placed
    self._hold: int | None = None  # while offered: no item of a later program is taken

  def put(self, items: list, program: int = 0, priority: bool = False, aliases=None) -> None:
    """Queues `items` of one request: ordinary (of controller program `program`; 0: none, as a
    save) or priority, placed here (the module doc). `aliases`: {handle: handle it is made from}
    for the values a priority request makes outside the queue (its receives on this worker: a
    copy is made once its source is)."""
    with self._cond:
      if priority:
        self._place(items, self._bound(items, aliases or {}, ()))
      else:
        self._program = max(self._program, program)
        for item in items:  # a program's own at 0; others after priority work placed after it
          self._append((self._program, 0 if program else 2, self._next()), item)
      self._cond.notify()

  def offer(self, items: list, aliases: dict, pulled) -> int:
    """Holds a priority program's `items` over several workers (phase one): the latest program
    they may follow here, reading `pulled` too (handles other workers' receives read here).
    Until `place`, no item of a later program is taken."""
    with self._cond:
      assert self._offered is None, "an offer is already held"
      self._offered = items
      self._hold = self._bound(items, aliases, pulled)
      return self._hold

  def place(self, after: int) -> None:
    """Queues the offered items after program `after` (phase two) and lets the queue go on."""
    with self._cond:
      items, self._offered, self._hold = self._offered or [], None, None
      self._place(items, max(after, self._bound([], {}, ())))
      self._cond.notify()

  def put_release(self, item) -> None:
    """A release, after everything queued now (ordinary)."""
    with self._cond:
      self._append((self._program, 2, self._next()), item)
      self._cond.notify()

  def get(self):
    """The next item, waiting for one (and while an offer holds the queue, for one that may run
    before any place the offer can take)."""
    with self._cond:
      while not self._items or (self._hold is not None and self._items[0][0][0] > self._hold):
        self._cond.wait()
      self._taken, item = self._items.pop(0)
      if self._taken[1] == 0:
        self._ahead = 0
      elif self._taken[1] == 1 and _executes(item):
        self._ahead += 1
      for handle in [h for h, o in self._makers.items() if o == self._taken]:
        del self._makers[handle]
      return item

  def drain(self) -> list:
    """Takes every queued item out (a Reset: they will never run)."""
    with self._cond:
      items = [item for _, item in self._items] + (self._offered or [])
      self._items, self._offered, self._hold = [], None, None
      self._makers.clear()
      self._cond.notify()
      return items

  def __len__(self) -> int:
    """The queued operations (Health's pending_ops; releases aside)."""
    with self._cond:
      return sum(item[0] is not None for _, item in self._items)

  def _next(self) -> int:
    self._arrivals += 1
    return self._arrivals

  def _append(self, order, item) -> None:
    self._items.append((order, item))
    self._remember(order, item)

  def _insert(self, order, item) -> None:
    index = next((i for i, (o, _) in enumerate(self._items) if o > order), len(self._items))
    self._items.insert(index, (order, item))
    self._remember(order, item)

  def _remember(self, order, item) -> None:
    if _executes(item):
      for out in item[0].execute.outputs:
        self._makers[out.handle] = order

  def _bound(self, items, aliases: dict, pulled) -> int:
    """The latest program priority `items` may follow here: the one begun, the previous
    priority work's, and those of the queued makers of what they (or `pulled`) read."""
    after = max([self._taken, self._last_priority, *self._makers_of(items, aliases, pulled)])[0]
    programs = sorted({o[0] for o, _ in self._items if o[1] == 0 and o[0] > after})
    while programs and self._run_after(after) >= AHEAD:
      after = programs.pop(0)  # past AHEAD in a row: after the next queued program
    return after

  def _run_after(self, program: int) -> int:
    """The priority executes that run in a row up to a place after `program`'s items."""
    queued = [o for o, item in self._items if o[0] == program and _executes(item)]
    run = sum(o[1] == 1 for o in queued)
    return run if any(o[1] == 0 for o in queued) else run + self._ahead

  def _place(self, items, after: int) -> None:
    for item in items:
      order = (after, 1, self._next())
      self._insert(order, item)
      self._last_priority = order

  def _makers_of(self, items, aliases: dict, pulled=()) -> list:
    """The orders of the queued items that make a value `items` (or `pulled`) read."""
    found = []
    for arg in [*(a for op, _ in items for a in _reads(op)), *pulled]:
      name, handle, _ = parse_arg(arg)
      if name in self._published:
        continue  # reads the newest published when it runs: made by work taken before it
      handle = aliases.get(handle, handle)
      if handle in self._makers:
        found.append(self._makers[handle])
    return found


def _reads(op) -> list:
  """The handles an op reads (none for a release)."""
  if op is None:
    return []
  kind = op.WhichOneof("kind")
  if kind == "execute":
    return list(op.execute.args)
  if kind == "save":
    return [item.handle for item in op.save.items]
  return []


def _executes(item) -> bool:
  op = item[0]
  return op is not None and op.WhichOneof("kind") == "execute"
