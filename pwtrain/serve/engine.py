"""The serving engine: continuous batching over a fixed set of KV-cache slots, run by one thread
that is a priority client of the controller (backend/policy.py).

Each choice of each prompt of a request is a sequence. Sequences wait in one queue, and a free
slot takes the oldest; a request whose sequences would leave more than serve.queue_size waiting
once the free slots are taken is refused (`QueueFull`, HTTP 429). The thread's loop:

  1. sequences whose client has gone (`Completion.cancel`) leave their slots, and waiting
     sequences take the free ones;
  2. while fewer than RUN_AHEAD programs are in flight: one prefill chunk (serve.prefill_chunk
     tokens) of each sequence still prefilling, all in one program (batches.py), so requests
     that arrive together start together; then one decode step of every decoding
     sequence (a token each), in turn; decodes leave the last place to a prefill, so that a
     new request's is dispatched as it comes, not after a decode in flight has run;
  3. the oldest program's tokens go to their clients, once it has run.

Every program is one token boundary of the sequences it serves: a sequence joins the batch with
its prefill and leaves it at its last token (EOS, a stop string, max_tokens, or its client
gone), so a long completion never holds a short one up, and prefill is interleaved with
decoding. Each slot's newest token stays on the device (pieces.py), so a decode is dispatched
without waiting for the one before it: up to RUN_AHEAD programs queue on the islands at once,
and a sequence that ends may have had up to RUN_AHEAD - 2 more tokens computed, then dropped.
While training runs, the islands run these programs between training steps (policy.py), so
run-ahead is what lets more than one token per slot go between two steps. The programs have
the same shapes every time: nothing recompiles.

Weights. A token comes from the weights published on the islands when its program launched
(weights.py): attached to a training run, the latest step launched before it; standalone, the
latest checkpoint loaded. A completion that outlives a step moves to the newer weights at its
next token (its earlier tokens' keys and values stay as they were computed), and its choices
say exactly which steps produced which tokens (`Event.step`; the app reports runs of steps).
Moving, not keeping, the start weights is what serving in place allows: keeping them would
need a copy of the parameters for as long as the completion runs, since the next step donates
them.

Faults. A program that fails because the weights moved (not published yet, an island lost,
an array it read deleted: a pod's rejoin replaced the state) makes the engine start again on
what is there: the layout read again (a live pod), its pieces compiled if new, the caches made
afresh, and every sequence in a slot prefilled again with its prompt and the tokens it was
given, which it then continues; no request fails for it. Any other failure fails the requests
of the program (or the token, or the sequence whose own inputs failed) it came from, no
others, and the rest start again the same way.
"""

import collections
import logging
import threading
import time

from pwtrain.backend.faults import IslandLost
from pwtrain.backend.program import NotPublished
from pwtrain.serve import batches, tokens
from pwtrain.serve import pieces as pieces_lib
from pwtrain.serve.flights import Flight, Landing, fetch
from pwtrain.serve.metrics import Stats
from pwtrain.serve.sequences import (
  Completion,
  Event,
  QueueFull,
  Sequence,
  Stopped,
  choice_seed,
)
from pwtrain.serve.text import TextStream
from pwtrain.serve.weights import NoLivePod

log = logging.getLogger(__name__)

RUN_AHEAD = 4  # programs in flight at once
RETRY_S = 0.05  # how soon to look again for weights not published yet or a live pod
FAILED_S = 1.0  # how soon to start again after a failure that is not one of those


class Engine:
  """The engine over `source` (weights.LiveWeights or CheckpointWeights), whose controller runs
  its programs; `settings`: serve.* (max_batch, max_len, prefill_chunk, queue_size)."""

  def __init__(self, source, controller, tokenizer, settings, stats: Stats | None = None):
    self.source = source
    self.controller = controller
    self.tokenizer = tokenizer
    self.max_batch, self.max_len = settings.max_batch, settings.max_len
    self.chunk = min(settings.prefill_chunk, settings.max_len)
    self.queue_size = settings.queue_size
    self.stats = stats or Stats()
    self._lock = threading.Condition()
    self._waiting: collections.deque = collections.deque()
    self._slots: list[Sequence | None] = [None] * self.max_batch
    self._built: dict = {}  # layout key -> Pieces
    self._pieces: pieces_lib.Pieces | None = None
    self._served = None  # the key of the layout served last
    self._carried: dict = {}  # the caches and `last`: the newest program's outputs
    self._flights: collections.deque = collections.deque()
    self._landing = Landing(self._lock, controller)  # marks each flight ready
    self._prefill_next = True  # prefill chunks and decode steps take turns
    self._stopping = False
    self.step: int | None = None  # the step of the weights of the last token
    # Pieces built, but no weights published on their islands yet (a remote run before its
    # first step is sent: remote/dispatch.py's publish).
    self.awaiting_weights = False
    self.error: str | None = None  # the last failure that was not a lost island or weights
    self._thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)
    self._thread.start()

  # -- the HTTP side -------------------------------------------------------------------------

  def submit(self, completion: Completion) -> None:
    """Queues the completion's sequences; QueueFull if they do not fit."""
    request = completion.request
    with self._lock:
      if self._stopping:
        raise Stopped("the server is stopping")
      free = sum(seq is None for seq in self._slots)
      if len(self._waiting) + request.num_sequences - free > self.queue_size:
        raise QueueFull(
          f"{len(self._waiting)} sequences wait for a slot, and serve.queue_size="
          f"{self.queue_size} cannot take {request.num_sequences} more"
        )
      for p, prompt in enumerate(request.encoded):
        for c in range(request.n):
          index = p * request.n + c
          self._waiting.append(
            Sequence(
              completion,
              index,
              prompt,
              choice_seed(request.seed, index),
              TextStream(self.tokenizer, request.stop),
            )  # fmt: skip
          )
      self._lock.notify()

  def wake(self) -> None:
    """Tells the engine to look again (a client left)."""
    with self._lock:
      self._lock.notify()

  def status(self) -> dict:
    with self._lock:
      pieces = self._pieces
      return {
        "serving": pieces is not None,
        "awaiting_weights": self.awaiting_weights and pieces is None,
        "step": self.step,
        "slots": self.max_batch,
        "busy": sum(s is not None for s in self._slots),
        "waiting": len(self._waiting),
        "islands": list(pieces.layout.islands) if pieces else [],
        "cache_bytes": pieces.cache_bytes if pieces else 0,
      }

  def stop(self) -> None:
    """Ends every sequence (with an error event) and stops the thread."""
    with self._lock:
      self._stopping = True
      self._lock.notify()
    self._thread.join()
    self._landing.stop()

  # -- the loop --------------------------------------------------------------------------------

  def _loop(self) -> None:
    while True:
      with self._lock:
        if self._stopping:
          break
        self._leave_cancelled()
        self._admit()
        idle = not any(self._slots) and not self._flights
        if idle and self._pieces is not None:
          self._lock.wait()
          continue
      try:
        if not self._ready():  # built as soon as the engine starts, then on every new layout
          time.sleep(RETRY_S)
          continue
        while len(self._flights) < RUN_AHEAD and self._dispatch():
          pass
        if self._flights:
          self._land()
      except Exception as e:  # noqa: BLE001 - a bug: the requests fail, the server goes on
        if _moved(e):
          log.warning("serving starts again on the live weights: %s", e)
          self._restart()
          time.sleep(RETRY_S)
          continue
        log.exception("serving failed")
        self.error = f"{type(e).__name__}: {e}"
        failed = getattr(e, "sequences", None)  # a program's or a sequence's own failure
        if failed is None:
          self._fail_all(f"the server failed: {self.error}")
        else:
          self._fail(failed, f"the server failed: {self.error}")
        self._restart()
        if failed is None:
          time.sleep(FAILED_S)
    self._fail_all("the server is stopping")

  def _leave_cancelled(self) -> None:
    for i, seq in enumerate(self._slots):
      if seq is not None and seq.completion.cancelled.is_set():
        seq.ended, self._slots[i] = True, None
        self.stats.count("cancelled")
    left = [s for s in self._waiting if s.completion.cancelled.is_set()]
    if left:
      self._waiting = collections.deque(s for s in self._waiting if s not in left)
      self.stats.count("cancelled", len(left))

  def _admit(self) -> None:
    for i, seq in enumerate(self._slots):
      if seq is None and self._waiting:
        seq = self._waiting.popleft()
        seq.slot = i
        seq.start()
        self._slots[i] = seq

  def _ready(self) -> bool:
    """Whether pieces for the current layout are built, their weights published and their
    caches made; builds what is missing (sequences in slots start again from their prefill)."""
    layout = self.source.layout()
    if self._pieces is not None and self._pieces.layout.key == layout.key:
      return True
    if self._pieces is not None:  # a new layout: what is in flight belongs to the old one
      self._restart()
    for each in (layout, *self.source.spares()):  # spares built ahead: failover compiles nothing
      if each.key not in self._built:
        start = time.perf_counter()
        self._built[each.key] = pieces = pieces_lib.build(
          self.controller, each, max_batch=self.max_batch, max_len=self.max_len,
          chunk=self.chunk, num_tokens=self.tokenizer.vocab_size,
        )  # fmt: skip
        took, mib = time.perf_counter() - start, pieces.cache_bytes / 2**20
        log.info("serving pieces for islands %s compiled in %.2f s (KV caches: %.2f MiB)",
                 ",".join(each.islands), took, mib)  # fmt: skip
    pieces = self._built[layout.key]
    try:
      probe = self.controller.run(pieces.probe, pieces.probe_inputs(), priority=True)
      fetch(probe, self.controller)
    except NotPublished:
      self.awaiting_weights = True
      return False
    self.awaiting_weights = False
    self._carried = self.controller.run(pieces.init, {}, priority=True)
    if self._served != layout.key:  # moved (not started again on the same islands)
      log.info("serving from islands %s", ",".join(layout.islands))
    self._pieces, self._served = pieces, layout.key
    return True

  def _restart(self) -> None:
    """Drops what is in flight and the caches; every sequence in a slot starts again from its
    prefill (of its prompt and the tokens it was given)."""
    self._pieces, self._carried = None, {}
    self._flights.clear()
    for seq in self._slots:
      if seq is not None:
        seq.start()

  def _dispatch(self) -> bool:
    """Dispatches the next program: a prefill chunk of every sequence still prefilling (one
    program) or a decode step of every decoding one (not into the last place in flight), in turn;
    False: none."""
    active = [s for s in self._slots if s is not None]
    prefilling = [s for s in active if s.prefilling]
    decoding = [s for s in active if s.decoding] if len(self._flights) < RUN_AHEAD - 1 else []
    if prefilling and (self._prefill_next or not decoding):
      serves, dispatch = prefilling, lambda: self._prefill(prefilling)
    elif decoding:
      serves, dispatch = decoding, lambda: self._decode(decoding)
    else:
      return False
    try:
      dispatch()
    except Exception as e:  # noqa: BLE001 - the sequences it was for fail, no others
      raise e if _moved(e) else _failing(e, getattr(e, "sequences", serves)) from None
    self._prefill_next = not prefilling or not self._prefill_next
    return True

  def _run(self, program, batch: batches.Batch, serves: list) -> None:
    inputs = {**self._pieces.weights(), **self._carried, **batch.inputs}
    outputs = self.controller.run(program, inputs, priority=True)
    self._carried = {k: v for k, v in outputs.items() if k.startswith("cache/") or k == "last"}
    outputs = {k: v for k, v in outputs.items() if k not in self._carried}
    flight = Flight(outputs, batch.rows, serves, batch.scored)
    self._flights.append(flight)
    self._landing.watch(flight)

  def _prefill(self, prefilling: list) -> None:
    pieces = self._pieces
    batch = batches.prefill(
      prefilling, shapes=pieces.prefill, max_batch=self.max_batch, chunk=self.chunk,
      max_len=self.max_len, pad_id=self.tokenizer.pad_id,
    )  # fmt: skip
    self.stats.count("prefill_chunks")
    self._run(pieces.prefill[batch.shape], batch, prefilling)
    for seq in batch.rows.values():
      seq.asked += 1

  def _decode(self, decoding: list) -> None:
    batch = batches.decode(decoding, max_batch=self.max_batch, max_len=self.max_len)
    self.stats.count("decode_steps")
    self._run(self._pieces.decode, batch, decoding)
    for seq in decoding:
      seq.fed, seq.asked = seq.fed + 1, seq.asked + 1

  def _land(self) -> None:
    """Waits for the oldest program in flight (or for a new request or a client leaving, to
    dispatch for them meanwhile) and gives its tokens to their clients."""
    flight = self._flights[0]
    with self._lock:
      if not flight.ready.is_set():
        self._lock.wait()
    if not flight.ready.is_set():
      return
    self._flights.popleft()
    if flight.error is not None:
      error = flight.error
      raise error if _moved(error) else _failing(error, flight.serves)
    values = flight.values
    steps = {int(v) for k, v in values.items() if k.startswith("step/")}
    assert len(steps) == 1, f"the cells read the weights of different steps: {sorted(steps)}"
    self.step = steps.pop()
    for seq, count, row in flight.scored:  # an echo's prompt log-probs, row `row`'s
      scores = {k: v[row] for k, v in values["out"]["scores"].items()}
      tokens.scored(seq, count, scores, self.tokenizer)
    for row, seq in flight.rows.items():
      if not seq.ended:
        try:
          self._give(seq, values["out"], row)
        except Exception as e:  # noqa: BLE001 - this sequence's own: it alone fails
          log.exception("serving a token failed")
          self._fail([seq], f"the server failed: {type(e).__name__}: {e}")

  def _give(self, seq: Sequence, out: dict, row: int) -> None:
    """The sequence's next token (row `row` of `out`) to its client; frees its slot at its end."""
    event = tokens.next_event(seq, out, row, self.step, self.tokenizer, self.stats)
    if event.finish_reason is not None:
      self._end(seq, event.finish_reason)
    seq.completion.on_event(event)

  def _end(self, seq: Sequence, finish: str) -> None:
    seq.ended = True
    with self._lock:
      self._slots = [None if s is seq else s for s in self._slots]
    self.stats.count(f"finished_{finish}")

  def _fail_all(self, message: str) -> None:
    with self._lock:
      self._fail([s for s in self._slots if s is not None] + list(self._waiting), message)

  def _fail(self, sequences, message: str) -> None:
    """Ends `sequences` (and the other choices of their requests) with an error event."""
    completions = {id(s.completion) for s in sequences}
    with self._lock:
      ended = [s for s in self._slots if s is not None and id(s.completion) in completions]
      ended += [s for s in self._waiting if id(s.completion) in completions]
      self._slots = [None if s in ended else s for s in self._slots]
      self._waiting = collections.deque(s for s in self._waiting if s not in ended)
    for seq in ended:
      seq.ended = True
      self.stats.count("failed")
      seq.completion.on_event(Event(seq.index, "", self.step or 0, error=message))


def _moved(error: BaseException) -> bool:
  """Whether `error` says the weights moved (the module doc's Faults). A deleted array is
  Python's RuntimeError or, deleted after that check, the runtime's ValueError."""
  if isinstance(error, IslandLost | NotPublished | NoLivePod):
    return True
  return isinstance(error, RuntimeError | ValueError) and "has been deleted" in str(error)


def _failing(error: BaseException, sequences) -> BaseException:
  error.sequences = list(sequences)  # whose program it failed: the engine fails those alone
  return error
