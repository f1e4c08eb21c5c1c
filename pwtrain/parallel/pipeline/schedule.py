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
interleaved (Megatron's interleaved 1F1B, `parallel.virtual_stages=v`): the model is cut into
S·v chunks and island i holds chunks i, i+S, ..., so each microbatch goes around the islands v
times; an island runs its chunks' forwards in groups of S microbatches per chunk, a warm-up of
2(S-1-i) + (v-1)S forwards, then one forward and one backward alternately (`interleaved_order`).
Each chunk is a stage of its own (the last chunk's FB runs where its forward would).
`interleave` merges the islands' node lists into the one dispatch order the controller
enqueues.
"""

from pwtrain.backend import Node

SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved")


def splits_backward(schedule: str, stage) -> bool:
  """Whether `stage`'s backward is split into B (input gradient) and W (parameter gradient)."""
  return schedule == "zero_bubble" and not stage.first


def island_order(schedule: str, stage, num_stages: int, num_micro: int, virtual: int = 1) -> list:
  """The compute nodes of one stage (of `num_stages`; interleaved: one chunk of `num_stages`
  = S·v), as ("F"|"B"|"FB"|"W", microbatch), in schedule order."""
  if schedule == "interleaved":
    islands = num_stages // virtual
    order = interleaved_order(stage.index % islands, islands, virtual, num_micro)
    return [(kind, m) for chunk, kind, m in order if chunk == stage.index]
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


def interleaved_order(island: int, num_islands: int, virtual: int, num_micro: int) -> list:
  """Island `island`'s compute nodes under the interleaved schedule, as (chunk, "F"|"B"|"FB",
  microbatch): its k-th forward is of chunk (k // S) % v of its own and microbatch
  (k // (S v)) S + k % S, its k-th backward the same with the chunks in reverse; a warm-up of
  2(S-1-i) + (v-1)S forwards, then one forward and one backward alternately, then the last
  backwards. The model's last chunk runs FB in its forward's place and no backward."""
  s, v, m = num_islands, virtual, num_micro
  last, total = s * v - 1, m * v

  def item(k: int, backward: bool) -> tuple:
    local = (k // s) % v
    return (v - 1 - local if backward else local) * s + island, (k // (s * v)) * s + k % s

  warmup = min(2 * (s - 1 - island) + (v - 1) * s, total)
  steps = [("F", k) for k in range(warmup)]
  for j in range(total - warmup):
    steps += [("F", warmup + j), ("B", j)]
  steps += [("B", k) for k in range(total - warmup, total)]
  order = []
  for kind, k in steps:
    chunk, micro = item(k, kind == "B")
    if chunk != last:
      order.append((chunk, kind, micro))
    elif kind == "F":
      order.append((chunk, "FB", micro))
  return order


def island_orders(schedule: str, stages: list, num_micro: int, virtual: int = 1) -> list:
  """Every island's compute nodes as (stage, kind, microbatch) in schedule order, island by
  island: one stage each, or (interleaved) its v chunks."""
  if schedule == "interleaved":
    islands = len(stages) // virtual
    return [interleaved_order(i, islands, virtual, num_micro) for i in range(islands)]
  return [
    [(st.index, kind, m) for kind, m in island_order(schedule, st, len(stages), num_micro)]
    for st in stages
  ]


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


def peak_pending_weights(order: list) -> int:
  """Most microbatches whose backward is split under `order` (zero_bubble) and whose W has not
  run yet: from B (FB on the last stage) to W, what a stage holds for W. 0 for an order that
  does not split."""
  change = {"F": 0, "B": 1, "FB": 1, "W": -1}
  if not any(kind == "W" for kind, _ in order):
    return 0
  pending = peak = 0
  for kind, _ in order:
    pending += change[kind]
    peak = max(peak, pending)
  return peak


def makespan(schedule: str, stages: list, num_micro: int, cost: dict, virtual: int = 1) -> float:
  """The step's length under `schedule` when every island runs its order as soon as each
  node's inputs are there, with `cost` {"F", "B", "W", "FB"} per piece of one microbatch on one
  island's share of the model (B and FB whole where the backward is not split; split, B and FB
  lose W's share; a chunk of v takes 1/v) and transfers free: a count from the schedule, not a
  measurement."""
  orders = island_orders(schedule, stages, num_micro, virtual)
  last = len(stages) - 1
  done: dict = {}  # (stage, kind, m) -> finish time
  clock = [0.0] * len(orders)
  position = [0] * len(orders)

  def ready(s, kind, m):
    """When the node's inputs from other stages are there (None: not yet known)."""
    if kind == "F" or (kind == "FB" and s > 0):
      return 0.0 if s == 0 else done.get((s - 1, "F", m))
    if kind == "B":
      return done.get((s + 1, "FB" if s + 1 == last else "B", m))
    return 0.0  # W: only its own stage's B before it, which ran earlier on the island

  def duration(s, kind):
    if kind in ("B", "FB") and splits_backward(schedule, stages[s]):
      return (cost[kind] - cost["W"]) / virtual
    return cost[kind] / virtual

  while any(position[i] < len(order) for i, order in enumerate(orders)):
    progressed = False
    for i, order in enumerate(orders):
      while position[i] < len(order):
        s, kind, m = order[position[i]]
        at = ready(s, kind, m)
        if at is None:
          break
        clock[i] = max(clock[i], at) + duration(s, kind)
        done[(s, kind, m)] = clock[i]
        position[i] += 1
        progressed = True
    assert progressed, "schedule deadlock: no island can make progress"
  return max(clock)


def bubble(schedule: str, stages: list, num_micro: int, virtual: int = 1) -> float:
  """The step's length over M microbatches' work of one island when F, B and W take 1, 2 and 1
  (FB 3) and transfers are free: (M + S - 1) / M for gpipe and 1f1b, less for zero_bubble and
  interleaved (a count from the schedule, `makespan`)."""
  cost = {"F": 1.0, "B": 2.0, "W": 1.0, "FB": 3.0}
  return makespan(schedule, stages, num_micro, cost, virtual) / (num_micro * cost["FB"])


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
