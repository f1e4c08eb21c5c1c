"""The schedule: in which order each island runs its stage's microbatches.

GPipe: all forwards, then all backwards, so a stage holds the inputs of all M microbatches.
1F1B: a warm-up of S-1-s forwards, then one forward and one backward alternately, so stage s
holds at most S-s. The last stage runs forward, loss and backward as one piece (FB) per
microbatch. zero_bubble (in the manner of ZB-H1, Qi et al. 2023): 1F1B's order, but every stage
after the first splits its backward into B, the input's gradient (all that the stage before
waits for), and W, the parameters' gradient, which nobody waits for: each stage runs W of its
previous microbatch after each B (FB on the last stage: forward, loss and the input's gradient),
so a gradient travels back to the first stage by B's alone and the W's fill the time a stage
would spend waiting. The first stage has no input gradient to send: its B stays whole. A stage
after the first holds one microbatch more than under 1F1B (its last B's W not yet run).
`interleave` merges the islands' node lists into the one dispatch order the controller
enqueues.
"""

from pwtrain.backend import Node

SCHEDULES = ("gpipe", "1f1b", "zero_bubble")


def splits_backward(schedule: str, stage) -> bool:
  """Whether `stage`'s backward is split into B (input gradient) and W (parameter gradient)."""
  return schedule == "zero_bubble" and not stage.first


def island_order(schedule: str, stage, num_stages: int, num_micro: int) -> list:
  """The compute nodes of one stage, as ("F"|"B"|"FB"|"W", microbatch), in schedule order."""
  if stage.last:
    order = [("FB", m) for m in range(num_micro)]
  elif schedule == "gpipe":
    return [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]
  else:
    warmup = min(num_stages - 1 - stage.index, num_micro)
    order = [("F", m) for m in range(warmup)]
    for i in range(num_micro - warmup):
      order += [("F", warmup + i), ("B", i)]
    order += [("B", m) for m in range(num_micro - warmup, num_micro)]
  if not splits_backward(schedule, stage):
    return order
  split = []
  for kind, m in order:  # W of the previous microbatch after each B
    split.append((kind, m))
    if kind in ("B", "FB") and m > 0:
      split.append(("W", m - 1))
  return split + [("W", num_micro - 1)]


def peak_live_inputs(order: list) -> int:
  """Most microbatches a stage holds at once under `order`: from F (FB, where W follows) to the
  piece that last needs the microbatch's input (B, or W where the backward is split)."""
  split = any(kind == "W" for kind, _ in order)
  change = {"F": 1, "B": 0 if split else -1, "W": -1, "FB": 1 if split else 0}
  live = peak = 0
  for kind, _ in order:
    live += change[kind]
    peak = max(peak, live)
  return peak


def makespan(schedule: str, stages: list, num_micro: int, cost: dict) -> float:
  """The step's length under `schedule` when every island runs its order as soon as each
  node's inputs are there, with `cost` {"F", "B", "W", "FB"} per piece of one microbatch (B and
  FB whole where the backward is not split; split, B and FB lose W's share) and transfers free:
  a count from the schedule, not a measurement."""
  num_stages = len(stages)
  orders = [island_order(schedule, st, num_stages, num_micro) for st in stages]
  done: dict = {}  # (stage, kind, m) -> finish time
  clock = [0.0] * num_stages
  position = [0] * num_stages

  def ready(s, kind, m):
    """When the node's inputs from other stages are there (None: not yet known)."""
    if kind == "F" or (kind == "FB" and s > 0):
      return 0.0 if s == 0 else done.get((s - 1, "F", m))
    if kind == "B":
      after = "FB" if s + 1 == num_stages - 1 else "B"
      return done.get((s + 1, after, m))
    return 0.0  # W: only its own stage's B before it, which ran earlier on the island

  def duration(s, kind):
    if kind in ("B", "FB") and splits_backward(schedule, stages[s]):
      return cost[kind] - cost["W"]
    return cost[kind]

  while any(position[s] < len(orders[s]) for s in range(num_stages)):
    progressed = False
    for s in range(num_stages):
      while position[s] < len(orders[s]):
        kind, m = orders[s][position[s]]
        at = ready(s, kind, m)
        if at is None:
          break
        clock[s] = max(clock[s], at) + duration(s, kind)
        done[(s, kind, m)] = clock[s]
        position[s] += 1
        progressed = True
    assert progressed, "schedule deadlock: no island can make progress"
  return max(clock)


def bubble(schedule: str, stages: list, num_micro: int) -> float:
  """The step's length over M microbatches' work of one stage when F, B and W take 1, 2 and 1
  (FB 3) and transfers are free: (M + S - 1) / M for gpipe and 1f1b, less for zero_bubble (a
  count from the schedule, `makespan`)."""
  cost = {"F": 1.0, "B": 2.0, "W": 1.0, "FB": 3.0}
  return makespan(schedule, stages, num_micro, cost) / (num_micro * cost["FB"])


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
