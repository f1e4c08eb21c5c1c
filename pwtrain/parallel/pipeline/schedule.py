"""The schedule: in which order each island runs its stage's microbatches.

GPipe: all forwards, then all backwards, so a stage holds the inputs of all M microbatches.
1F1B: a warm-up of S-1-s forwards, then one forward and one backward alternately, so stage s
holds at most S-s. The last stage runs forward, loss and backward as one piece (FB) per
microbatch. `interleave` merges the islands' node lists into the one dispatch order the
controller enqueues.
"""

from pwtrain.backend import Node

SCHEDULES = ("gpipe", "1f1b")


def island_order(schedule: str, stage, num_stages: int, num_micro: int) -> list:
  """The compute nodes of one stage, as ("F"|"B"|"FB", microbatch), in schedule order."""
  if stage.last:
    return [("FB", m) for m in range(num_micro)]
  if schedule == "gpipe":
    return [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]
  warmup = min(num_stages - 1 - stage.index, num_micro)
  order = [("F", m) for m in range(warmup)]
  for i in range(num_micro - warmup):
    order += [("F", warmup + i), ("B", i)]
  return order + [("B", m) for m in range(num_micro - warmup, num_micro)]


def peak_live_inputs(order: list) -> int:
  """Most microbatch inputs a stage holds at once (saved at F, freed by B) under `order`."""
  live = peak = 0
  for kind, _ in order:
    live += {"F": 1, "B": -1, "FB": 0}[kind]
    peak = max(peak, live)
  return peak


def interleave(per_island: list[list]) -> tuple:
  """One dispatch order that keeps each island's order and puts producers before consumers."""
  queues = [list(q) for q in per_island]
  emitted: set[str] = set()
  order = []
  while any(queues):
    progressed = False
    for q in queues:
      while q and all(isinstance(r, str) or r[0] in emitted for r in _refs(q[0])):
        node = q.pop(0)
        order.append(node)
        emitted.add(node.name)
        progressed = True
    assert progressed, "schedule deadlock: no island can make progress"
  return tuple(order)


def _refs(node):
  return node.args if isinstance(node, Node) else (node.src,)
