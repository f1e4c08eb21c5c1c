"""A sequence's text as its tokens arrive: what may be sent so far, and where a stop string ends it.

The text is the tokenizer's decoding of every new token so far (never the prompt). What is sent
is a prefix that no later token can change: a trailing U+FFFD (the bytes of a character not yet
complete, as the byte tokenizer decodes them) waits for the rest of the character, and a tail
that could be the start of a stop string waits until it is one or is not. A stop string ends
the text before it (OpenAI's rule: the stop string is not returned).
"""

REPLACEMENT = "\ufffd"


class TextStream:
  def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
    self.tokenizer = tokenizer
    self.stop = stop
    self.ids: list[int] = []
    self.text = ""  # the whole text so far (ends at a stop string once one is met)
    self.sent = 0  # characters of `text` given out

  def add(self, token: int) -> tuple[str, bool]:
    """Adds a new token: (the text that may be sent now, whether a stop string was met)."""
    self.ids.append(int(token))
    text = self.tokenizer.decode(self.ids)
    earliest = None
    for stop in self.stop:
      found = text.find(stop, max(0, self.sent - len(stop) + 1))
      if found >= 0 and (earliest is None or found < earliest):
        earliest = found
    if earliest is not None:
      self.text = text[:earliest]
      return self._take(len(self.text)), True
    self.text = text
    safe = len(text)
    while safe > self.sent and text[safe - 1] == REPLACEMENT:
      safe -= 1
    held = 0  # the longest tail that starts a stop string
    for stop in self.stop:
      for k in range(min(len(stop) - 1, safe - self.sent), held, -1):
        if text[:safe].endswith(stop[:k]):
          held = k
          break
    return self._take(safe - held), False

  def finish(self) -> str:
    """Everything not sent yet (the sequence ended)."""
    return self._take(len(self.text))

  def _take(self, end: int) -> str:
    out, self.sent = self.text[self.sent : end], max(self.sent, end)
    return out


def token_text(tokenizer, token: int) -> str:
  """A token's text in logprobs: its decoding alone, or, for a byte of a character (the byte
  tokenizer's), `bytes:\\xNN` as OpenAI writes such a piece."""
  text = tokenizer.decode([token])
  offset = getattr(tokenizer, "offset", None)  # data.ByteTokenizer's first byte id
  if REPLACEMENT in text and offset is not None and token >= offset:
    return f"bytes:\\x{token - offset:02x}"
  return text
