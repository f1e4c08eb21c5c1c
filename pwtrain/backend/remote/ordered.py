"""A worker's execution queue (server.py): one order of operations, taken in turn by its one
thread, with a priority client's operations placed ahead of queued ordinary ones.

Every item has a place in the order, `(request, kind, arrival)`:

  ordinary   the operations of an Enqueue (a program's, a save's, the releases it carries; a
             Release call's too) join the end, in arrival order; each ordinary Enqueue is the
             worker's next request number. The controller sends programs one at a time
             (Controller.run), so every worker sees the programs it shares in dispatch order.
  priority   the operations of a priority Enqueue (Controller.run(priority=True): serving) join
             right after the latest of: the request the worker has taken an item of (begun),
             the previous priority operations (which so keep their order), and the queued
             item that makes a value they read (a reader placed ahead of its value's maker
             would wait for it forever). They go ahead of every queued item of a later
             request, never ahead of an item already taken. A published value they read
             (`@name=`, program.Latest) is the newest one published by the work run before
             them, as on an embedded island; only while nothing is published under the name
             do they wait for the value the controller named. The releases a priority Enqueue
             carries are ordinary: a value released is dropped after every queued reader.

The controller sends a program as priority only when it touches one worker (remote/dispatch.py):
a program over several would need every worker it touches to place it after the same request,
which each worker alone cannot know; those join the end of every queue, in dispatch order, as
ordinary programs do, so two workers never run two programs in opposite orders.
"""

import re
import threading

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
    self._request = 0  # the latest ordinary request's number
    self._arrivals = 0
    self._taken: tuple = (0, 0, 0)  # the order of the latest item taken
    self._last_priority: tuple = (0, 0, 0)

  def put(self, items: list, priority: bool = False, aliases=None) -> None:
    """Queues `items` of one request, ordinary or priority (the module doc). `aliases`: {handle:
    handle it is made from} for the values a priority request makes outside the queue (its
    receives on this worker: a copy is made once its source is)."""
    with self._cond:
      if not priority:
        self._request += 1
        for item in items:
          self._append((self._request, 0, self._next()), item)
      else:
        after = max([self._taken, self._last_priority, *self._makers_of(items, aliases or {})])
        for item in items:
          order = (after[0], 1, self._next())
          self._insert(order, item)
          self._last_priority = order
      self._cond.notify()

  def put_release(self, item) -> None:
    """A release, after everything queued now (ordinary)."""
    with self._cond:
      self._append((self._request, 0, self._next()), item)
      self._cond.notify()

  def get(self):
    """The next item, waiting for one."""
    with self._cond:
      while not self._items:
        self._cond.wait()
      self._taken, item = self._items.pop(0)
      for handle in [h for h, o in self._makers.items() if o == self._taken]:
        del self._makers[handle]
      return item

  def drain(self) -> list:
    """Takes every queued item out (a Reset: they will never run)."""
    with self._cond:
      items, self._items = [item for _, item in self._items], []
      self._makers.clear()
      return items

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)

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
    op = item[0]
    if op is not None and op.WhichOneof("kind") == "execute":
      for out in op.execute.outputs:
        self._makers[out.handle] = order

  def _makers_of(self, items, aliases: dict) -> list:
    """The orders of the queued items that make a value `items` read."""
    found = []
    for op, _ in items:
      for arg in _reads(op):
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
