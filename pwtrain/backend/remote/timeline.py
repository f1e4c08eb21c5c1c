"""The workers' timelines on the controller's trace (backend.trace in remote mode): each traced
node's launch and done, as its worker measured them, moved onto the controller's clock."""

import time


def collect(trace, traced: dict, islands, wait_s: float) -> None:
  """Fills `trace`'s events of `traced` ({trace id: (event, worker)}, popped as they are
  filled) from the timelines of the live workers of `islands`, on the controller's clock (each
  worker's offset from `clock_offset`); waits up to `wait_s` for nodes still running, and leaves
  out those that never ran."""
  deadline = time.monotonic() + wait_s
  for island in islands:
    worker = island.worker
    if worker.lost or worker.closed:
      continue
    offset = clock_offset(worker)
    while True:
      for span in worker.timeline().spans:
        event, _ = traced.pop(span.trace_id, (None, None))
        if event is not None:
          event.launch = trace.from_wall(span.start - offset)
          event.done = trace.from_wall(span.end - offset)
      if time.monotonic() > deadline or not any(w is worker for _, w in traced.values()):
        break
      time.sleep(0.05)


def clock_offset(worker, pings: int = 5) -> float:
  """The worker's clock minus the controller's, in seconds: from the quickest of `pings` Health
  round trips (its answer's time against the trip's midpoint, off by at most half that trip),
  so that one trip slowed by a busy machine does not skew it."""
  trips = []
  for _ in range(pings):
    sent = time.time()
    answer = worker.health().time
    back = time.time()
    trips.append((back - sent, answer - (sent + back) / 2))
  return min(trips)[1]
