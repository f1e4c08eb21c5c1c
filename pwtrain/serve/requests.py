"""What a client may ask: an OpenAI completions request body, parsed and checked, and the errors a
client gets back, in OpenAI's shape ({"error": {"message", "type", "param", "code"}}).

Every check names the field, the value and what is valid; a body that fails one is refused with
HTTP 400 before anything is queued, and every number that reaches the engine is range-checked
here (an integer past int32, a temperature past MAX_TEMPERATURE, a seed past 64 bits), so that no
request can fail in the engine's thread and take other requests with it. Prompts are tokenized
here (the tokenizer is numpy: the HTTP side never touches device arrays), each as the start of a
document by the rule `pwtrain.sample` follows (`tokenizer.prompt`: after an end-of-document
token for pwtrain's own tokenizers, with the family's BOS for an imported model's), counted in
the prompt's tokens; a prompt given as token ids is those ids. A sequence of n prompt tokens and
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
  """A checked request: `encoded[i]` is prompt i's token ids (as a document starts: after EOS,
  or with the family's BOS; or the ids the client gave); `n` choices each; with `echo`, each
  choice's log-probs start with its prompt's."""

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
  echo: bool = False  # the prompt (and with logprobs its tokens' log-probs) first
  ignore_eos: bool = False  # EOS does not end a sequence (RL with rl.stop_at_eos=False)

  @property
  def num_sequences(self) -> int:
    return len(self.prompts) * self.n


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server takes (from serve.*): positions per sequence and slots."""

  max_len: int
  max_batch: int


INT32_MAX = 2**31 - 1  # the engine's per-row settings are int32 (pieces.SAMPLING)
MAX_TEMPERATURE = 100.0
SEED_RANGE = (-(2**63), 2**64)  # choice_seed reads a seed modulo 2**64


def read_json(body: bytes) -> dict:
  """The JSON object in `body`; RequestError(400) for anything else: bytes that are not UTF-8,
  malformed JSON, an integer of more digits than Python converts, nesting deeper than the
  parser's recursion."""
  try:
    text = body.decode("utf-8")
  except UnicodeDecodeError as e:
    raise RequestError(400, f"the request body is not UTF-8 (byte {e.start}: {e.reason})") from e
  try:
    fields = json.loads(text)
  except json.JSONDecodeError as e:
    raise RequestError(400, f"the request body is not valid JSON: {e}") from e
  except ValueError as e:  # an integer over sys.get_int_max_str_digits() digits
    raise RequestError(400, f"the request body has a number out of range: {e}") from e
  except RecursionError as e:
    raise RequestError(400, "the request body is nested too deeply") from e
  if not isinstance(fields, dict):
    raise RequestError(400, f"the request body must be a JSON object, not {type(fields).__name__}")
  return fields


def parse(body: bytes, tokenizer, limits: Limits) -> CompletionRequest:
  """The completions request in `body` (JSON bytes), checked; RequestError(400) naming what is
  wrong."""
  fields = read_json(body)
  _unsupported(fields)
  prompts, encoded = _prompts(fields.get("prompt"), tokenizer, limits)
  echo = _flag(fields, "echo")
  return checked(fields, prompts, encoded, limits, echo=echo, tokenizer=tokenizer)


def checked(fields: dict, prompts, encoded, limits: Limits, *, echo: bool, tokenizer):
  """The request of `encoded` prompts with the sampling fields of `fields` range-checked (every
  number that reaches the engine fits its type: a request cannot fail another)."""
  longest = max(len(ids) for ids in encoded)
  room = limits.max_len - longest
  low = 0 if echo else 1  # echo with max_tokens=0: the prompt's log-probs alone (likelihood)
  max_tokens = _integer(fields, "max_tokens", None, low, room, f"(the longest prompt is "
                        f"{longest} tokens of serve.max_len={limits.max_len})")  # fmt: skip
  if max_tokens is None:
    max_tokens = min(DEFAULT_MAX_TOKENS, room)
  fit = f"({len(prompts)} prompt(s) x n must fit serve.max_batch={limits.max_batch} slots)"
  n = _integer(fields, "n", 1, 1, limits.max_batch // len(prompts), fit)
  logprobs = _integer(fields, "logprobs", None, 0, MAX_LOGPROBS, "")
  seed = _integer(fields, "seed", None, SEED_RANGE[0], SEED_RANGE[1] - 1, "")
  stream = _flag(fields, "stream")
  options = fields.get("stream_options") or {}
  if not isinstance(options, dict):
    raise RequestError(400, f"stream_options={_short(options)} must be an object", "stream_options")
  top_k = _integer(fields, "top_k", 0, 0, INT32_MAX, "(0: off)")
  model = fields.get("model")
  return CompletionRequest(
    prompts=prompts,
    encoded=encoded,
    max_tokens=max_tokens,
    temperature=_number(
      fields,
      "temperature",
      1.0,
      lambda t: 0 <= t <= MAX_TEMPERATURE,
      f"in [0, {MAX_TEMPERATURE:g}] (0: greedy)",
    ),  # fmt: skip
    top_p=_number(fields, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1] (1: off)"),
    top_k=0 if top_k >= tokenizer.vocab_size else top_k,  # as many as there are ids: off
    n=n,
    stop=_stop(fields.get("stop")),
    seed=seed,
    stream=stream,
    include_usage=bool(options.get("include_usage", False)),
    logprobs=logprobs,
    echo=echo,
    model=model if isinstance(model, str) else None,
  )


def _unsupported(fields: dict) -> None:
  """Fields of OpenAI's API that would change the result and that this server does not do."""
  refused = {
    "suffix": fields.get("suffix") not in (None, ""),
    "best_of": fields.get("best_of") not in (None, 1, fields.get("n", 1)),
    "logit_bias": bool(fields.get("logit_bias")),
    "presence_penalty": fields.get("presence_penalty") not in (None, 0, 0.0),
    "frequency_penalty": fields.get("frequency_penalty") not in (None, 0, 0.0),
  }
  for name, bad in refused.items():
    if bad:
      message = f"{name}={_short(fields[name])} is not supported by this server"
      raise RequestError(400, message, name)


def _prompts(prompt, tokenizer, limits: Limits) -> tuple[tuple[str, ...], tuple]:
  """(the prompts' texts, their token ids): a string, a list of strings, a list of token ids or
  a list of such lists. A text prompt is encoded as the start of a document
  (`tokenizer.prompt`, the rule `pwtrain.sample` follows); token ids are the prompt as given."""
  if isinstance(prompt, str) or _ids(prompt):
    prompt = [prompt]
  ok = isinstance(prompt, list) and 0 < len(prompt) <= limits.max_batch
  if not ok or not all(isinstance(p, str) or _ids(p) for p in prompt):
    raise RequestError(
      400,
      f"prompt must be a string, a list of token ids, or a list of 1 to serve.max_batch="
      f"{limits.max_batch} of either; got {_short(prompt)}",
      "prompt",
    )
  texts, encoded = [], []
  for i, p in enumerate(prompt):
    if isinstance(p, str):
      ids = tokenizer.prompt(utf8(p, "prompt"))
    else:
      bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
      if bad:
        raise RequestError(
          400, f"prompt {i} has token id {bad[0]}, not in [0, {tokenizer.vocab_size})", "prompt"
        )
      ids = p
    encoded.append(fitting(np.asarray(ids, np.int32), i, limits))
    texts.append(p if isinstance(p, str) else tokenizer.decode(ids))
  return tuple(texts), tuple(encoded)


def _ids(value) -> bool:
  return (
    isinstance(value, list)
    and len(value) > 0
    and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
  )


def utf8(text: str, param: str) -> str:
  """`text`, which JSON may give with lone surrogates (\\ud800) that no tokenizer encodes."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise RequestError(
      400, f"{param} is not valid Unicode (character {e.start}: {e.reason})", param
    ) from e
  return text


def fitting(ids: np.ndarray, index: int, limits: Limits) -> np.ndarray:
  """`ids`, if they leave room for one new token in serve.max_len."""
  if len(ids) > limits.max_len - 1:
    which = f"prompt {index}" if index else "the prompt"
    raise RequestError(
      400,
      f"{which} is {len(ids)} tokens (with the special tokens a document starts with); "
      f"serve.max_len={limits.max_len} takes at most {limits.max_len - 1}, to leave room for "
      "one new token",
      "prompt",
      code="context_length_exceeded",
    )
  return ids


def _flag(fields, name) -> bool:
  value = fields.get(name, False)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise RequestError(400, f"{name}={_short(value)} must be true or false", name)
  return value


def _integer(fields, name, default, low, high, why):
  value = fields.get(name, default)
  if value is None:
    return default
  ok = isinstance(value, int) and not isinstance(value, bool)
  if not ok or value < low or (high is not None and value > high):
    top = "" if high is None else f" and <= {high}"
    message = f"{name}={_short(value)} must be an integer >= {low}{top} {why}".strip()
    raise RequestError(400, message, name)
  return value


def _number(fields, name, default, valid, what):
  value = fields.get(name, default)
  if value is None:
    return default
  ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or not valid(value):
    raise RequestError(400, f"{name}={_short(value)} must be a number {what}", name)
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
  return tuple(utf8(s, "stop") for s in stops)


def _short(value) -> str:
  text = json.dumps(value)[:100]
  return text if len(text) <= 80 else text[:77] + "..."
