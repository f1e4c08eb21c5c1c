"""What the serving engine serves (engine.py): a request being served (`Completion`), each of its
choices a `Sequence` in a KV-cache slot, and the `Event`s its client is told at token boundaries;
the refusals a request meets (`QueueFull`, `Stopped`); each row's sampling settings and seeds.
"""

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np

from pwtrain.serve import pieces as pieces_lib
from pwtrain.serve.requests import CompletionRequest
from pwtrain.serve.text import TextStream


class QueueFull(RuntimeError):
  """The request's sequences do not fit the waiting queue (serve.queue_size)."""


class Stopped(RuntimeError):
  """The engine has stopped (the server is shutting down)."""


@dataclasses.dataclass
class Event:
  """What a choice's client is told at a token boundary: new `text` (possibly ""), the token's
  log-probabilities when asked for ((token text, logprob, {top text: logprob})), the step of the
  weights that produced the token, the token's id, and the finish reason ("stop", "length") at
  the end. `error`: the choice ended without one (the server stopped, or failed).
  `sampled_logprob`: the token's log-probability under the distribution it was drawn from
  (pieces.py), as generated (RL trains on these, never on re-tokenised text)."""

  index: int
  text: str
  step: int
  logprobs: tuple | None = None
  finish_reason: str | None = None
  error: str | None = None
  token: int | None = None
  sampled_logprob: float | None = None
  echo: tuple | None = None  # with the first event of an echo: (prompt text, its log-probs)


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
class Sequence:
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
  scores: list = dataclasses.field(default_factory=list)  # an echo's prompt log-probs so far
  echoed: bool = False  # the echo went with its first event
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  last: float = 0.0  # when its last token was given

  def start(self) -> None:
    """(Again) from its prefill: its prompt and every token given so far."""
    self.context = np.concatenate([self.prompt, self.given]).astype(np.int32)
    self.fed, self.asked = 0, len(self.given)
    if not self.echoed:
      self.scores = []

  @property
  def prefilling(self) -> bool:
    return self.fed < len(self.context)

  @property
  def decoding(self) -> bool:
    return not self.prefilling and self.asked < self.completion.request.max_tokens


def sampling_rows(rows: dict, num_rows: int) -> dict:
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


def choice_seed(seed: int | None, index: int) -> int:
  """Choice `index`'s seed: from the request's (its choices differ), else random."""
  if seed is None:
    return secrets.randbits(32)
  return int(np.random.SeedSequence([seed % 2**64, index]).generate_state(1)[0])
