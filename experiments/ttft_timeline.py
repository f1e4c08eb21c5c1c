"""Where a request's time to first token goes: a timeline of each request of closed-loop clients
against a training run with the server attached (bench_serve.py's training section, one load).

  python experiments/ttft_timeline.py --clients=1 --seconds=15 --path=unserialized

Each request's moments, on one clock (time.monotonic, which the clients' process shares):
  sent       the client sent it (the clients' process)
  arrived    the engine got it (Engine.submit, from the HTTP handler)
  admitted   it took a slot (its sequence started)
  dispatched its prefill program was dispatched (Controller.run, priority)
  placed     the prefill's node joined the island's queue (the share allows it: policy.py)
  launched   the island's scheduler launched it
  computed   its outputs were ready (the completion watcher, or the end of its serialized run)
  fetched    the engine's landing thread had them on the host
  given      the engine gave the first token to the request's stream
  received   the client read its first chunk

For every stage, the p50 and p90 over the requests; and, for requests whose first token took
over a training step, what the island ran between dispatch and launch (training steps,
serving programs). The hooks wrap the engine, the policy and the scheduler from outside:
nothing in pwtrain changes for this script.
"""

import argparse
import collections
import contextlib
import itertools
import os
import statistics
import tempfile
import threading
import time

import bench_serve
from common import force_host_devices

STAGES = ("sent", "arrived", "admitted", "dispatched", "placed", "launched", "computed",
          "fetched", "given", "received")  # fmt: skip


class Hooks:
  """Wraps the engine, policy and scheduler methods that mark each moment (module doc)."""

  def __init__(self, trace):
    from pwtrain.backend import island_queue, policy
    from pwtrain.serve import engine, flights, sequences

    self.trace = trace
    self.offset = time.monotonic() - trace.now()  # trace clock + offset = time.monotonic
    self.requests: dict[int, dict] = {}  # id(completion) -> {stage: time}
    self.order: list[int] = []
    self.steps: dict[int, list] = {}  # controller step of a prefill -> [id(completion)]
    self._mapped: set[int] = set()  # the completions whose first prefill is in `steps`
    self.placed: dict[int, float] = {}  # controller step -> when its first node was placed
    self.held: dict[int, dict] = {}  # controller step -> the balance when it was dispatched
    self.fetched: dict[int, float] = {}  # controller step -> its outputs on the host
    self._tags: list[int] = []  # the completions whose prefill the engine dispatches now
    self._last_step: int | None = None
    lock = threading.Lock()
    hooks = self

    def wrap(owner, name, before=None, after=None):
      original = getattr(owner, name)

      def wrapped(*args, **kwargs):
        if before:
          before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
          after(result, *args, **kwargs)
        return result

      setattr(owner, name, wrapped)

    def submit(engine_, completion):
      with lock:
        self.requests[id(completion)] = {"arrived": time.monotonic()}
        self.order.append(id(completion))

    def start(seq):
      stamps = self.requests.get(id(seq.completion))
      if stamps is not None:
        stamps.setdefault("admitted", time.monotonic())

    def prefill(engine_, seqs):  # one program for every sequence still prefilling
      self._tags = [id(seq.completion) for seq in seqs if id(seq.completion) in self.requests]
      for tag in self._tags:
        self.requests[tag].setdefault("dispatched", time.monotonic())

    def prefilled(result, engine_, seqs):
      self._tags = []

    def insert(policy_, placed, number):
      (scheduler_, _), *_ = placed
      clock = scheduler_.clock
      if any(p is placed for p in policy_._held):
        self.held[number] = {"balance": clock._balance, "pending": clock._pending}

    def queued(queue, work):
      if work.priority and work.event is not None:
        self.placed.setdefault(work.event.step, time.monotonic())

    def watch(landing, flight):
      flight._timeline_step = self._last_step

    wrap(engine.Engine, "submit", before=submit)
    wrap(sequences.Sequence, "start", before=start)
    wrap(engine.Engine, "_prefill", before=prefill, after=prefilled)
    wrap(policy.PriorityPolicy, "insert", after=lambda r, p, placed, n: insert(p, placed, n))
    wrap(island_queue.OrderedQueue, "insert", before=queued)
    wrap(flights.Landing, "watch", before=watch)

    original_fetch = flights.fetch

    def landing_loop(landing):
      # the landing thread's loop, with the time each flight's outputs reached the host
      while (flight := landing._queue.get()) is not None:
        try:
          flight.values = original_fetch(flight.outputs, landing._controller)
        except BaseException as e:  # noqa: BLE001
          flight.error = e
        step = getattr(flight, "_timeline_step", None)
        if step is not None:
          hooks.fetched[step] = time.monotonic()
        flight.ready.set()
        with landing._lock:
          landing._lock.notify()

    flights.Landing._loop = landing_loop

    def give(engine_, seq, out, row):
      stamps = self.requests.get(id(seq.completion))
      if stamps is not None:
        stamps.setdefault("given", time.monotonic())

    wrap(engine.Engine, "_give", before=give)

  def hook_dispatcher(self, dispatcher):
    original = dispatcher.dispatch

    def dispatch(program, inputs, step, priority=False):
      if priority:
        self._last_step = step
        for tag in self._tags:
          if tag not in self._mapped:
            self._mapped.add(tag)
            self.steps.setdefault(step, []).append(tag)
      return original(program, inputs, step, priority)

    dispatcher.dispatch = dispatch

  def timelines(self, records: list[dict]) -> list[dict]:
    """Each request's stamps, its client's `sent` and `received` matched in order."""
    events = collections.defaultdict(list)
    for e in list(self.trace.events):
      events[e.step].append(e)
    for step, completion in ((s, c) for s, cs in self.steps.items() for c in cs):
      stamps = self.requests[completion]
      nodes = events.get(step, [])
      if nodes and "launched" not in stamps:
        launches = [e.launch for e in nodes if e.launch is not None]
        dones = [e.done for e in nodes if e.done is not None]
        if launches:
          stamps["launched"] = min(launches) + self.offset
        if dones:
          stamps["computed"] = max(dones) + self.offset
        if step in self.placed:
          stamps["placed"] = self.placed[step]
        if step in self.fetched:
          stamps["fetched"] = self.fetched[step]
        stamps["step"] = step
        stamps["held"] = self.held.get(step)
    ordered = [self.requests[i] for i in self.order]
    for stamps in ordered:  # the client's request: sent before it arrived, answered right after
      if "given" not in stamps:
        continue
      fits = [
        r
        for r in records
        if r["start"] <= stamps["arrived"] and r["times"][0] >= stamps["given"] - 0.001
      ]
      if fits:
        best = min(fits, key=lambda r: r["times"][0] - stamps["given"])
        stamps["sent"], stamps["received"] = best["start"], best["times"][0]
    return [s for s in ordered if all(k in s for k in self.stages)]

  @property
  def stages(self) -> tuple:
    """The stages measured: remote workers' queues have no `placed` here."""
    return tuple(k for k in STAGES if k != "placed" or self.placed)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--clients", type=int, default=1)
  parser.add_argument("--seconds", type=float, default=15.0)
  parser.add_argument("--tokens", type=int, default=8)
  parser.add_argument("--path", choices=("serialized", "unserialized"), default="unserialized")
  parser.add_argument("--remote", action="store_true", help="one worker process of 8 devices")
  parser.add_argument("--events", action="store_true", help="the island's nodes around each")
  parser.add_argument("--show", type=int, default=12, help="requests printed one by one")
  parser.add_argument("--skip", type=int, default=0, help="requests left out of the print")
  args = parser.parse_args()
  force_host_devices(8)
  from pwtrain.backend import Trace

  config = bench_serve._config(path=args.path)
  trace = Trace(record_completion=True)
  hooks = Hooks(trace)
  with contextlib.ExitStack() as stack:
    if args.remote:
      from pwtrain.backend.remote import auth, launcher

      workers = stack.enter_context(launcher.launch([8]))
      os.environ[auth.TOKEN_ENV] = workers.token
      config.backend.mode, config.backend.workers = "remote", tuple(workers.addresses)
    records, step_s, n = _run(args, config, trace, hooks)
  _report(args, trace, hooks, records, step_s, n)


def _run(args, config, trace, hooks):
  """The clients' records, the training step time while they ran, and its steps."""
  from pwtrain import serve
  from pwtrain.harness import Harness

  workdir = tempfile.mkdtemp(prefix="ttft_timeline_")
  serialize = False if args.path == "unserialized" else None
  build = dict(trace=trace) if args.remote else dict(trace=trace, serialize_execution=serialize)
  with Harness.build(config, **build) as harness, serve.listening(config) as sock:
    hooks.hook_dispatcher(harness.controller._dispatcher)
    state = harness.init()
    with serve.attached(config, harness.controller, lambda: harness, state, workdir, sock) as srv:
      trainer = bench_serve.Trainer(harness, state).start().started()
      time.sleep(2.0)
      start = time.monotonic()
      clients = bench_serve.Clients(srv.url, args.clients, args.tokens)
      time.sleep(args.seconds)
      records = clients.stop()
      end = time.monotonic()
      n, seconds = trainer.step_time(start, end)
      trainer.stop()
  return records, seconds / max(n, 1), n


def _report(args, trace, hooks, records, step_s, n):
  stages = hooks.stages
  rows = hooks.timelines(records)
  print(f"{len(rows)} requests timed, training step {step_s:.3f} s ({n} steps)")
  deltas = {f"{a}->{b}": [r[b] - r[a] for r in rows] for a, b in itertools.pairwise(stages)}
  deltas["ttft (client)"] = [r["received"] - r["sent"] for r in rows]
  for name, xs in deltas.items():
    xs = sorted(xs)
    p90 = xs[min(int(0.9 * len(xs)), len(xs) - 1)] if xs else float("nan")
    median = statistics.median(xs) if xs else float("nan")
    print(f"{name:22s} p50 {median * 1e3:8.1f} ms  p90 {p90 * 1e3:8.1f} ms")
  held = [r for r in rows if r["held"] is not None]
  print(f"prefills held back by the share: {len(held)} of {len(rows)}")
  # what ran on the island while each slow prefill waited
  train_events = sorted(
    (e for e in list(trace.events) if e.launch is not None and e.step not in hooks.steps),
    key=lambda e: e.launch,
  )
  for r in rows[args.skip : args.skip + args.show]:
    t0 = r["sent"]
    parts = " ".join(f"{k[:4]}={(r[k] - t0) * 1e3:6.1f}" for k in stages[1:])
    ran = [
      e.name
      for e in train_events
      if e.done is not None
      and e.done + hooks.offset > r["dispatched"]
      and e.launch + hooks.offset < r["launched"]
    ]
    counts = collections.Counter(n.split("/")[0] for n in ran)
    print(f"ms from sent: {parts} held={r['held']} ran between: {dict(counts)}")
    if args.events:
      for e in sorted(trace.events, key=lambda e: e.dispatch):
        if e.launch is None or e.done is None:
          continue
        launch, done = e.launch + hooks.offset - t0, e.done + hooks.offset - t0
        if done > -0.1 and launch < r["computed"] - t0:
          mark = "*" if e.step == r["step"] else " "
          dispatch = (e.dispatch + hooks.offset - t0) * 1e3
          print(
            f"   {mark}{e.name:24s} step {e.step:5d} disp {dispatch:7.1f}"
            f" launch {launch * 1e3:7.1f} done {done * 1e3:7.1f}"
          )


if __name__ == "__main__":
  main()
