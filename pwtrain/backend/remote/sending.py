"""How the controller sends a program's operations to its workers (remote/dispatch.py), and
where each worker queues them (the worker's ordered.py).

  ordinary         one Enqueue per worker, all at once, carrying the program's number: the end
                   of every worker's queue.
  priority, one    one priority Enqueue: its worker places it right after the latest program it
  worker           has begun (or the client's previous priority program, or the queued maker of
                   a value it reads).
  priority, more   two phases, so that every worker places it after the same program: an Offer
                   to each worker it touches (its ops, or only the handles others pull from it),
                   in island order, which holds that worker's queue and answers the latest
                   program the ops may follow there; then a Place after the latest answer. Two
                   workers so never run two programs in opposite orders (a cycle of waits
                   between their queues).
"""

import collections

import grpc

from pwtrain.backend.remote.values import rpc_error


def send(ops: dict, calls: list, program: int, priority: bool, islands, cluster) -> None:
  """Sends `ops` ({worker: [Op]}) of controller program number `program` and waits for every
  call of it (with `calls`, [(worker, future)] already started: its uploads)."""
  pulled = collections.defaultdict(list)  # worker -> handles other workers' receives read there
  by_address = {island.worker.address: island.worker for island in cluster.islands}
  for worker_ops in ops.values():
    for op in worker_ops:
      if op.WhichOneof("kind") == "receive" and op.receive.source:
        pulled[by_address[op.receive.source]].append(op.receive.handle)
  if not priority or (len(ops) == 1 and not pulled):
    for worker, worker_ops in ops.items():
      calls.append((worker, worker.enqueue_async(worker_ops, priority, program)))
    _wait(calls, islands)  # one round trip for the whole program, all islands at once
    return
  _wait(calls, islands)
  workers = sorted({*ops, *pulled}, key=lambda w: w.island)
  offers = [(w, w.enqueue_async(ops.get(w, []), True, program, pulled.get(w, []))) for w in workers]
  after = program  # if an offer fails: placed anyway (at the end), so no queue stays held
  try:
    after = max(reply.after for reply in _wait(offers, islands))
  finally:
    _wait([(w, w.place_async(after)) for w in workers], islands)


def _wait(calls: list, islands) -> list:
  """The calls' replies; a failed one raised as its worker's loss or error."""
  replies = []
  for worker, call in calls:
    try:
      replies.append(call.result())
    except grpc.FutureCancelledError:  # the worker was declared lost meanwhile
      raise worker.lost_error() from None
    except grpc.RpcError as e:
      raise rpc_error(worker, e, islands) from None
  return replies
