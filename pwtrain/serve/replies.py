"""A request's OpenAI response, built from the engine's events: a completion (`Reply`,
"text_completion") or a chat completion (`ChatReply`, "chat.completion"), whole or as streamed
chunks.

Every response names the weights that produced it: `system_fingerprint` is `pwtrain-step-<N>`,
N the step of its newest token's weights (a streamed chunk: of its own token; the usage chunk:
of the newest token of the whole response). Each choice's `weights` lists the runs of steps its
tokens came from, [{"step", "tokens"}], in order, and `token_ids` its new tokens' ids (a streamed
chunk: its own token's). With `echo`, a choice's text starts with its prompt's, and with
`logprobs` its log-probs start with its prompt tokens' (the first token's log-prob and top are
null), as OpenAI's legacy completions give them.
"""

import uuid

from pwtrain.serve.requests import CompletionRequest
from pwtrain.serve.sequences import Completion, Event


class Reply:
  """A completions response (module doc)."""

  object = "text_completion"
  prefix = "cmpl"

  def __init__(self, completion: Completion, model: str):
    self.completion = completion
    request: CompletionRequest = completion.request
    self.head = {
      "id": f"{self.prefix}-{uuid.uuid4().hex}",
      "object": self.object,
      "created": int(completion.created),
      "model": model,
    }
    count = request.num_sequences
    self.texts = [""] * count
    self.finish: list = [None] * count
    self.steps: list[list] = [[] for _ in range(count)]  # runs: [step, tokens]
    self.ids: list[list[int]] = [[] for _ in range(count)]
    self.logprobs = None
    if request.logprobs is not None:
      self.logprobs = [_empty_logprobs() for _ in range(count)]
    self.ended = 0
    self.newest = -1  # the step of the newest token's weights
    self.added = 0

  @property
  def done(self) -> bool:
    return self.ended == len(self.texts)

  def add(self, event: Event) -> None:
    i = event.index
    self.newest = max(self.newest, event.step)
    self.added = 0  # log-prob entries this event adds
    if event.echo is not None:  # the prompt first
      prompt, scores = event.echo
      self.texts[i] += prompt
      if self.logprobs is not None and scores is not None:
        for entry in scores:
          _append_logprobs(self.logprobs[i], entry)
        self.added += len(scores)
    self.texts[i] += event.text
    if event.token is not None:
      self.ids[i].append(event.token)
      runs = self.steps[i]
      if runs and runs[-1][0] == event.step:
        runs[-1][1] += 1
      else:
        runs.append([event.step, 1])
    if self.logprobs is not None and event.logprobs is not None:
      _append_logprobs(self.logprobs[i], event.logprobs)
      self.added += 1
    if event.finish_reason is not None:
      self.finish[i] = event.finish_reason
      self.ended += 1

  def chunk(self, event: Event) -> dict:
    """The streamed chunk of `event` (after `add`)."""
    logprobs = None
    if self.logprobs is not None and self.added:
      logprobs = {k: v[-self.added :] for k, v in self.logprobs[event.index].items()}
    text = event.text if event.echo is None else event.echo[0] + event.text
    choice = {"index": event.index, **self._content(text, chunk=True),
              "logprobs": logprobs, "finish_reason": event.finish_reason,
              "token_ids": [] if event.token is None else [event.token]}  # fmt: skip
    return {**self.head, **self._chunk_object(), "system_fingerprint": _fingerprint(event.step),
            "choices": [choice]}  # fmt: skip

  def usage_chunk(self) -> dict:
    return {**self.head, **self._chunk_object(), "system_fingerprint": self._newest(),
            "choices": [], "usage": self._usage()}  # fmt: skip

  def whole(self) -> dict:
    choices = [
      {
        "index": i,
        **self._content(text, chunk=False),
        "logprobs": self.logprobs[i] if self.logprobs is not None else None,
        "finish_reason": self.finish[i],
        "weights": [{"step": step, "tokens": n} for step, n in self.steps[i]],
        "token_ids": self.ids[i],
      }
      for i, text in enumerate(self.texts)
    ]
    return {**self.head, "system_fingerprint": self._newest(), "choices": choices,
            "usage": self._usage()}  # fmt: skip

  def _content(self, text: str, *, chunk: bool) -> dict:
    return {"text": text}

  def _chunk_object(self) -> dict:
    return {}

  def _newest(self) -> str:
    return _fingerprint(self.newest)

  def _usage(self) -> dict:
    prompt, completion = self.completion.prompt_tokens, self.completion.completion_tokens
    return {
      "prompt_tokens": prompt,
      "completion_tokens": completion,
      "total_tokens": prompt + completion,
    }


class ChatReply(Reply):
  """A chat completions response: each choice's text is the assistant's `message` (streamed: a
  `delta`, the first of each choice with the role)."""

  object = "chat.completion"
  prefix = "chatcmpl"

  def __init__(self, completion: Completion, model: str):
    super().__init__(completion, model)
    self._started: set[int] = set()

  def _content(self, text: str, *, chunk: bool) -> dict:
    if not chunk:
      return {"message": {"role": "assistant", "content": text}}
    return {"delta": {"content": text}}

  def chunk(self, event: Event) -> dict:
    out = super().chunk(event)
    if event.index not in self._started:
      self._started.add(event.index)
      out["choices"][0]["delta"]["role"] = "assistant"
    return out

  def _chunk_object(self) -> dict:
    return {"object": "chat.completion.chunk"}


def _fingerprint(step: int) -> str:
  return f"pwtrain-step-{step}"


def _empty_logprobs() -> dict:
  return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _append_logprobs(out: dict, logprobs: tuple) -> dict:
  token, logprob, top = logprobs
  offset = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else 0
  out["tokens"].append(token)
  out["token_logprobs"].append(logprob)
  out["top_logprobs"].append(top)
  out["text_offset"].append(offset)
  return out
