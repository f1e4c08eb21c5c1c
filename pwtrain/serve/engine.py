"""The serving engine: continuous batching over a fixed set of KV-cache slots, run by one thread
that is a priority client of the controller (backend/policy.py).

Each choice of each prompt of a request is a sequence. Sequences wait in one queue, and a free
slot takes the oldest; a request whose sequences would leave more than serve.queue_size waiting
once the free slots are taken is refused (`QueueFull`, HTTP 429). The thread's loop:

  1. sequences whose client has gone (`Completion.cancel`) leave their slots, and waiting
     sequences take the free ones;
  2. while fewer than RUN_AHEAD programs are in flight: one prefill chunk (serve.prefill_chunk
     tokens) of each sequence still prefilling, then one decode step of every decoding
     sequence (a token each);
  3. the oldest program's tokens go to their clients, once it has run.

Every program is one token boundary of the sequences it serves: a sequence joins the batch with
its prefill and leaves it at its last token (EOS, a stop string, max_tokens, or its client
gone), so a long completion never holds a short one up, and prefill is interleaved with
decoding. Each slot's newest token stays on the device (pieces.py), so a decode is dispatched
without waiting for the one before it: up to RUN_AHEAD programs queue on the islands at once,
and a sequence that ends may have had up to RUN_AHEAD - 1 more tokens computed, then dropped.
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

Faults. A program that fails because the weights are not published yet, or because an island
was lost (elastic pods), makes the engine start again on what is there: the layout read again
(a live pod), its pieces compiled if new, the caches made afresh, and every sequence in a slot
prefilled again with its prompt and the tokens it was given, which it then continues. The
server itself never stops for it.
"""

import collections
import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from pwtrain.backend.faults import IslandLost
from pwtrain.backend.program import NotPublished
from pwtrain.serve import pieces as pieces_lib
from pwtrain.serve.metrics import Stats
from pwtrain.serve.requests import CompletionRequest
from pwtrain.serve.text import TextStream, token_text
from pwtrain.serve.weights import NoLivePod

log = logging.getLogger(__name__)

RUN_AHEAD = 4  # programs in flight at once
RETRY_S = 0.05  # how soon to look again for weights not published yet or a live pod
FAILED_S = 1.0  # how soon to start again after a failure that is not one of those


class QueueFull(RuntimeError):
  """The request's sequences do not fit the waiting queue (serve.queue_size)."""


class Stopped(RuntimeError):
  """The engine has stopped (the server is shutting down)."""


@dataclasses.dataclass
class Event:
  """What a choice's client is told at a token boundary: new `text` (possibly ""), the token's
  log-probabilities when asked for ((token text, logprob, {top text: logprob})), the step of the
  weights that produced the token, and the finish reason ("stop", "length") at the end. `error`:
  the choice ended without one (the server stopped, or failed)."""

  index: int
  text: str
  step: int
  logprobs: tuple | None = None
  finish_reason: str | None = None
  error: str | None = None


class Completion:
  """One request being served: its sequences' events go to `on_event` (called on the engine's
  thread, in order per choice); `cancel` (the client left) frees their slots at the next token
  boundary."""

  def __init__(self, request: CompletionRequest, on_event: Callable[[Event], None]):
    self.request = request
    self.on_event = on_event
    self.cancelled = threading.Event()
    self.created = time.time()
    self.prompt_tokens = sum(len(ids) for ids in request.encoded)
    self.completion_tokens = 0

  def cancel(self) -> None:
    self.cancelled.set()


@dataclasses.dataclass(eq=False)
class _Sequence:
  completion: Completion
  index: int  # the choice: prompt p's choice c is p * n + c
  prompt: np.ndarray
  seed: int  # uint32: token t's draw is fold_in(key(seed), t)
  text: TextStream
  slot: int | None = None
  context: np.ndarray | None = None  # what its prefill feeds: the prompt, then tokens given
  fed: int = 0  # positions of its slot's cache that the dispatched programs fill
  asked: int = 0  # tokens the dispatched programs produce for it (its next one's index)
  given: list = dataclasses.field(default_factory=list)  # tokens given to its client
  ended: bool = False
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  last: float = 0.0  # when its last token was given

  def start(self) -> None:
    """(Again) from its prefill: its prompt and every token given so far."""
    self.context = np.concatenate([self.prompt, self.given]).astype(np.int32)
    self.fed, self.asked = 0, len(self.given)

  @property
  def prefilling(self) -> bool:
    return self.fed < len(self.context)

  @property
  def decoding(self) -> bool:
    return not self.prefilling and self.asked < self.completion.request.max_tokens


@dataclasses.dataclass
class _Flight:
  """A dispatched program: its outputs, and which sequence each row's token is for."""

  outputs: dict
  rows: dict  # row -> sequence
  ready: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None


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
    self._slots: list[_Sequence | None] = [None] * self.max_batch
    self._built: dict = {}  # layout key -> Pieces
    self._pieces: pieces_lib.Pieces | None = None
    self._carried: dict = {}  # the caches and `last`: the newest program's outputs
    self._flights: collections.deque = collections.deque()
    self._landing = _Watcher(self._lock)  # marks each flight ready once it has run
    self._prefill_next = True  # prefill chunks and decode steps take turns
    self._stopping = False
    self.step: int | None = None  # the step of the weights of the last token
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
            _Sequence(
              completion,
              index,
              prompt,
              _seed(request.seed, index),
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
      except (IslandLost, NotPublished, NoLivePod) as e:
        log.warning("serving starts again on the live weights: %s", e)
        self._restart()
        time.sleep(RETRY_S)
      except Exception as e:  # noqa: BLE001 - a bug: the requests fail, the server goes on
        log.exception("serving failed")
        self.error = f"{type(e).__name__}: {e}"
        self._fail_all(f"the server failed: {self.error}")
        self._restart()
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
    pieces = self._built.get(layout.key)
    if pieces is None:
      start = time.perf_counter()
      pieces = pieces_lib.build(
        self.controller, layout, max_batch=self.max_batch, max_len=self.max_len,
        chunk=self.chunk, num_tokens=self.tokenizer.vocab_size,
      )  # fmt: skip
      self._built[layout.key] = pieces
      log.info(
        "serving pieces for islands %s compiled in %.2f s (KV caches: %.2f MiB)",
        ",".join(layout.islands), time.perf_counter() - start, pieces.cache_bytes / 2**20,
      )  # fmt: skip
    try:
      probe = self.controller.run(pieces.probe, pieces.probe_inputs(), priority=True)
      jax.block_until_ready([f.result() for f in probe.values()])
    except NotPublished:
      return False
    self._carried = self.controller.run(pieces.init, {}, priority=True)
    self._pieces = pieces
    log.info("serving from islands %s", ",".join(layout.islands))
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
    """Dispatches the next program: a prefill chunk of the first sequence still prefilling or
    a decode step of every decoding one, in turn while there are both; False if there is
    nothing to run."""
    active = [s for s in self._slots if s is not None]
    prefilling = [s for s in active if s.prefilling]
    decoding = [s for s in active if s.decoding]
    if prefilling and (self._prefill_next or not decoding):
      self._prefill(prefilling[0])
    elif decoding:
      self._decode(decoding)
    else:
      return False
    self._prefill_next = not prefilling or not self._prefill_next
    return True

  def _run(self, program, inputs: dict, rows: dict) -> None:
    inputs = {**self._pieces.weights(), **self._carried, **inputs}
    outputs = self.controller.run(program, inputs, priority=True)
    self._carried = {k: v for k, v in outputs.items() if k.startswith("cache/") or k == "last"}
    flight = _Flight({k: v for k, v in outputs.items() if k not in self._carried}, rows)
    self._flights.append(flight)
    self._landing.watch(flight)

  def _prefill(self, seq: _Sequence) -> None:
    start, piece = seq.fed, seq.context[seq.fed : seq.fed + self.chunk]
    tokens = np.full((1, self.chunk), self.tokenizer.pad_id, np.int32)
    tokens[0, : len(piece)] = piece
    positions = np.minimum(start + np.arange(self.chunk), self.max_len - 1)[None].astype(np.int32)
    seq.fed = start + len(piece)
    final = seq.fed == len(seq.context)
    inputs = {
      "tokens": tokens,
      "positions": positions,
      "slot": np.asarray([seq.slot], np.int32),
      "logits_at": np.asarray([len(piece) - 1], np.int32),
      "final": np.asarray([final]),
      "sampling": _sampling({0: seq}, 1),
    }
    self.stats.count("prefill_chunks")
    self._run(self._pieces.prefill, inputs, {0: seq} if final else {})
    if final:
      seq.asked += 1

  def _decode(self, decoding: list) -> None:
    positions = np.full((self.max_batch, 1), self.max_len - 1, np.int32)
    active = np.zeros(self.max_batch, bool)
    rows = {}
    for seq in decoding:
      positions[seq.slot, 0], active[seq.slot] = seq.fed, True
      rows[seq.slot] = seq
    inputs = {"positions": positions, "active": active, "sampling": _sampling(rows, self.max_batch)}
    self.stats.count("decode_steps")
    self._run(self._pieces.decode, inputs, rows)
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
      raise flight.error
    values = jax.device_get({k: f.result() for k, f in flight.outputs.items()})
    steps = {int(v) for k, v in values.items() if k.startswith("step/")}
    assert len(steps) == 1, f"the cells read the weights of different steps: {sorted(steps)}"
    self.step = steps.pop()
    for row, seq in flight.rows.items():
      if not seq.ended:
        self._give(seq, values["out"], row)

  def _give(self, seq: _Sequence, out: dict, row: int) -> None:
    """The sequence's next token (row `row` of `out`) to its client; frees its slot at its end."""
    token = int(out["token"][row])
    now = time.perf_counter()
    if seq.given:
      self.stats.observe("time_per_output_token_seconds", now - seq.last)
    else:
      self.stats.observe("time_to_first_token_seconds", now - seq.submitted)
    seq.last = now
    seq.given.append(token)
    seq.completion.completion_tokens += 1
    self.stats.count("completion_tokens")
    request = seq.completion.request
    if token == self.tokenizer.eos_id:
      finish, text = "stop", seq.text.finish()
    else:
      text, stopped = seq.text.add(token)
      finish = "stop" if stopped else None
    if finish is None and len(seq.given) >= request.max_tokens:
      finish, text = "length", text + seq.text.finish()
    logprobs = None
    if request.logprobs is not None:
      top = {
        token_text(self.tokenizer, int(i)): float(lp)
        for i, lp in zip(out["top_ids"][row][: request.logprobs],
                         out["top_logprobs"][row][: request.logprobs], strict=True)
      }  # fmt: skip
      logprobs = (token_text(self.tokenizer, token), float(out["logprob"][row]), top)
    if finish is not None:
      seq.ended = True
      with self._lock:
        if self._slots[seq.slot] is seq:
          self._slots[seq.slot] = None
      self.stats.count(f"finished_{finish}")
    seq.completion.on_event(Event(seq.index, text, self.step, logprobs, finish))

  def _fail_all(self, message: str) -> None:
    with self._lock:
      ended = [s for s in self._slots if s is not None] + list(self._waiting)
      self._slots = [None] * self.max_batch
      self._waiting.clear()
    for seq in ended:
      seq.ended = True
      seq.completion.on_event(Event(seq.index, "", self.step or 0, error=message))


class _Watcher:
  """One thread that waits for each flight's outputs in turn (programs run in the order they
  were dispatched), marks it ready (or failed), and wakes the engine."""

  def __init__(self, lock: threading.Condition):
    self._lock = lock
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._loop, name="serve-landing", daemon=True)
    self._thread.start()

  def watch(self, flight: _Flight) -> None:
    self._queue.put(flight)

  def _loop(self) -> None:
    while (flight := self._queue.get()) is not None:
      try:
        jax.block_until_ready([f.result() for f in flight.outputs.values()])
      except BaseException as e:  # noqa: BLE001 - raised on the engine's thread
        flight.error = e
      flight.ready.set()
      with self._lock:
        self._lock.notify()

  def stop(self) -> None:
    self._queue.put(None)
    self._thread.join()


def _sampling(rows: dict, num_rows: int) -> dict:
  """Each row's sampling settings and key parts (pieces.SAMPLING); other rows greedy."""
  out = {k: np.zeros(num_rows, dtype) for k, dtype in pieces_lib.SAMPLING.items()}
  out["top_p"][:] = 1.0
  for row, seq in rows.items():
    request = seq.completion.request
    out["temperature"][row] = request.temperature
    out["top_k"][row] = request.top_k
    out["top_p"][row] = request.top_p
    out["seed"][row] = seq.seed
    out["count"][row] = seq.asked
  return out


def _seed(seed: int | None, index: int) -> int:
  """Choice `index`'s seed: from the request's (its choices differ), else random."""
  if seed is None:
    return secrets.randbits(32)
  return int(np.random.SeedSequence([seed % 2**64, index]).generate_state(1)[0])
