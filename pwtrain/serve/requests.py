"""What a client may ask: an OpenAI completions request body, parsed and checked, and the errors a
client gets back, in OpenAI's shape ({"error": {"message", "type", "param", "code"}}).

Every check names the field, the value and what is valid; a body that fails one is refused with
HTTP 400 before anything is queued. Prompts are tokenized here (the tokenizer is numpy: the HTTP
side never touches device arrays), each as the start of a document, after an EOS, as
`pwtrain.sample` feeds it; a prompt's tokens count that EOS. A sequence of n prompt tokens and
m new ones needs n + m <= serve.max_len positions (pieces.py keeps the last one as scratch).
"""

import dataclasses
import json
import math

import numpy as np

MAX_LOGPROBS = 5  # pieces.TOP
MAX_STOP = 4  # OpenAI's limit on stop strings
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class RequestError(Exception):
  """A request the server refuses: its HTTP status and OpenAI-style error body."""

  def __init__(self, status: int, message: str, param: str | None = None, *, kind=None, code=None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.param = param
    self.kind = kind or {400: "invalid_request_error", 401: "authentication_error"}.get(
      status, "server_error" if status >= 500 else "invalid_request_error"
    )
    self.code = code

  def body(self) -> dict:
    return {
      "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
    }


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A checked request: `encoded[i]` is prompt i's token ids (EOS first); `n` choices each."""

  prompts: tuple[str, ...]
  encoded: tuple[np.ndarray, ...]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  n: int
  stop: tuple[str, ...]
  seed: int | None
  stream: bool
  include_usage: bool  # stream_options.include_usage: a last chunk with the usage
  logprobs: int | None
  model: str | None
  ignore_eos: bool = False  # EOS does not end a sequence (RL with rl.stop_at_eos=False)

  @property
  def num_sequences(self) -> int:
    return len(self.prompts) * self.n


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server takes (from serve.*): positions per sequence and slots."""

  max_len: int
  max_batch: int


def parse(body: bytes, tokenizer, limits: Limits) -> CompletionRequest:
  """The request in `body` (JSON bytes), checked; RequestError(400) naming what is wrong."""
  try:
    text = body.decode("utf-8")
  except UnicodeDecodeError as e:
    raise RequestError(400, f"the request body is not UTF-8 (byte {e.start}: {e.reason})") from e
  try:
    fields = json.loads(text)
  except json.JSONDecodeError as e:
    raise RequestError(400, f"the request body is not valid JSON: {e}") from e
  if not isinstance(fields, dict):
    raise RequestError(400, f"the request body must be a JSON object, not {type(fields).__name__}")
  _unsupported(fields)
  prompts = _prompts(fields.get("prompt"), limits)
  encoded = tuple(_encode(tokenizer, p, i, limits) for i, p in enumerate(prompts))
  longest = max(len(ids) for ids in encoded)
  room = limits.max_len - longest
  max_tokens = _integer(fields, "max_tokens", None, 1, room, f"(the longest prompt is {longest} "
                        f"tokens of serve.max_len={limits.max_len})")  # fmt: skip
  if max_tokens is None:
    max_tokens = min(DEFAULT_MAX_TOKENS, room)
  fit = f"({len(prompts)} prompt(s) x n must fit serve.max_batch={limits.max_batch} slots)"
  n = _integer(fields, "n", 1, 1, limits.max_batch // len(prompts), fit)
  logprobs = _integer(fields, "logprobs", None, 0, MAX_LOGPROBS, "")
  seed = fields.get("seed")
  if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
    raise RequestError(400, f"seed={seed!r} must be an integer", "seed")
  stream = fields.get("stream", False)
  if not isinstance(stream, bool):
    raise RequestError(400, f"stream={stream!r} must be true or false", "stream")
  options = fields.get("stream_options") or {}
  if not isinstance(options, dict):
    raise RequestError(400, f"stream_options={options!r} must be an object", "stream_options")
  model = fields.get("model")
  return CompletionRequest(
    prompts=prompts,
    encoded=encoded,
    max_tokens=max_tokens,
    temperature=_number(fields, "temperature", 1.0, lambda t: t >= 0, ">= 0 (0: greedy)"),
    top_p=_number(fields, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1] (1: off)"),
    top_k=_integer(fields, "top_k", 0, 0, None, "(0: off)"),
    n=n,
    stop=_stop(fields.get("stop")),
    seed=seed,
    stream=stream,
    include_usage=bool(options.get("include_usage", False)),
    logprobs=logprobs,
    model=model if isinstance(model, str) else None,
  )


def _unsupported(fields: dict) -> None:
  """Fields of OpenAI's API that would change the result and that this server does not do."""
  refused = {
    "echo": fields.get("echo") not in (None, False),
    "suffix": fields.get("suffix") not in (None, ""),
    "best_of": fields.get("best_of") not in (None, 1, fields.get("n", 1)),
    "logit_bias": bool(fields.get("logit_bias")),
    "presence_penalty": fields.get("presence_penalty") not in (None, 0, 0.0),
    "frequency_penalty": fields.get("frequency_penalty") not in (None, 0, 0.0),
  }
  for name, bad in refused.items():
    if bad:
      raise RequestError(400, f"{name}={fields[name]!r} is not supported by this server", name)


def _prompts(prompt, limits: Limits) -> tuple[str, ...]:
  if isinstance(prompt, str):
    return (prompt,)
  if (
    isinstance(prompt, list)
    and prompt
    and all(isinstance(p, str) for p in prompt)
    and len(prompt) <= limits.max_batch
  ):
    return tuple(prompt)
  raise RequestError(
    400,
    f"prompt must be a string or a list of 1 to serve.max_batch={limits.max_batch} strings; got "
    f"{_short(prompt)}",
    "prompt",
  )


def _encode(tokenizer, prompt: str, index: int, limits: Limits) -> np.ndarray:
  ids = tokenizer.prompt(prompt)  # as pwtrain.sample encodes it (data/tokenizer.py)
  if len(ids) > limits.max_len - 1:
    which = f"prompt {index}" if index else "the prompt"
    raise RequestError(
      400,
      f"{which} is {len(ids)} tokens (with the EOS or BOS it starts with); "
      f"serve.max_len={limits.max_len} takes at most {limits.max_len - 1}, to leave room for "
      "one new token",
      "prompt",
      code="context_length_exceeded",
    )
  return ids


def _integer(fields, name, default, low, high, why):
  value = fields.get(name, default)
  if value is None:
    return default
  ok = isinstance(value, int) and not isinstance(value, bool)
  if not ok or value < low or (high is not None and value > high):
    top = "" if high is None else f" and <= {high}"
    message = f"{name}={value!r} must be an integer >= {low}{top} {why}".strip()
    raise RequestError(400, message, name)
  return value


def _number(fields, name, default, valid, what):
  value = fields.get(name, default)
  if value is None:
    return default
  ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or not valid(value):
    raise RequestError(400, f"{name}={value!r} must be a number {what}", name)
  return float(value)


def _stop(stop) -> tuple[str, ...]:
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if (
    not isinstance(stops, list)
    or len(stops) > MAX_STOP
    or not all(isinstance(s, str) and s for s in stops)
  ):
    raise RequestError(
      400, f"stop={_short(stop)} must be a non-empty string or a list of up to {MAX_STOP}", "stop"
    )
  return tuple(stops)


def _short(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 80 else text[:77] + "..."
