"""Chat completions: a request's messages rendered into one prompt by the model's chat template,
the Hugging Face tokenizer's `chat_template` (in `tokenizer_config.json`, or `chat_template.jinja`
beside it), with jinja2 as transformers renders it (a sandboxed environment, trim_blocks and
lstrip_blocks, the loop controls, `raise_exception`, `strftime_now`, and `messages`,
`add_generation_prompt=True` and the tokenizer's special tokens' texts as variables). The text
is encoded as it is (the template writes any BOS itself, as transformers' apply_chat_template
does); the sampling fields are the completions API's (requests.py), `max_completion_tokens`
standing for `max_tokens`. A model without a template is refused with one line.
"""

import datetime
import json
import os

import numpy as np

from pwtrain.serve.requests import Limits, RequestError, checked, fitting, read_json, utf8

ROLES = ("system", "developer", "user", "assistant", "tool")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplate:
  """A compiled chat template and the special tokens' texts it may name."""

  def __init__(self, source: str, special: dict):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
    self.template = env.from_string(source)
    self.special = special

  def render(self, messages: list) -> str:
    return self.template.render(messages=messages, add_generation_prompt=True, **self.special)


def load(config, workdir: str) -> ChatTemplate | None:
  """The run's tokenizer's chat template (module doc); None when it has none."""
  if config.data.tokenizer != "huggingface" or not config.data.tokenizer_path:
    return None
  directory = os.path.dirname(os.path.join(workdir, config.data.tokenizer_path))
  settings = {}
  path = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(path):
    with open(path) as f:
      settings = json.load(f)
  source = settings.get("chat_template")
  if isinstance(source, list):  # named templates: the default one
    source = next((t["template"] for t in source if t.get("name") == "default"), None)
  jinja = os.path.join(directory, "chat_template.jinja")
  if source is None and os.path.isfile(jinja):
    with open(jinja) as f:
      source = f.read()
  if not source:
    return None
  special = {k: _text(settings.get(k)) for k in SPECIAL}
  return ChatTemplate(source, special)


def parse(body: bytes, template: ChatTemplate | None, tokenizer, limits: Limits):
  """The chat request in `body` as a completion of its rendered messages (requests.checked)."""
  if template is None:
    raise RequestError(
      400, "this model has no chat template (its tokenizer's chat_template); use /v1/completions"
    )
  fields = read_json(body)
  messages = _messages(fields.get("messages"))
  if fields.get("logprobs") not in (None, False):
    raise RequestError(400, "logprobs is not supported on chat completions", "logprobs")
  for name in ("tools", "functions", "response_format", "logit_bias"):
    if fields.get(name):
      raise RequestError(400, f"{name} is not supported by this server", name)
  if fields.get("max_tokens") is None and fields.get("max_completion_tokens") is not None:
    fields["max_tokens"] = fields["max_completion_tokens"]
  fields = {k: v for k, v in fields.items() if k not in ("logprobs", "top_logprobs")}
  try:
    text = template.render(messages)
  except Exception as e:  # noqa: BLE001 - the template's own errors (raise_exception, ...)
    raise RequestError(400, f"the chat template refused the messages: {e}", "messages") from e
  ids = fitting(np.asarray(tokenizer.encode(text), np.int32), 0, limits)
  return checked(fields, (text,), (ids,), limits, echo=False, tokenizer=tokenizer)


def _messages(messages) -> list:
  if not isinstance(messages, list) or not messages:
    raise RequestError(400, "messages must be a non-empty list of {role, content}", "messages")
  out = []
  for i, m in enumerate(messages):
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ROLES:
      raise RequestError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
    content = m.get("content")
    if isinstance(content, list):  # parts: the text ones, joined
      if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise RequestError(400, f"messages[{i}].content: only text parts are supported", "messages")
      content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
      raise RequestError(400, f"messages[{i}].content must be a string", "messages")
    out.append({**m, "role": role, "content": utf8(content, "messages")})
  return out


def _text(token) -> str:
  if isinstance(token, dict):
    return str(token.get("content", ""))
  return token or ""


def _tojson(value, indent=None):
  return json.dumps(value, indent=indent, ensure_ascii=False)


def _raise(message: str):
  raise ValueError(message)
