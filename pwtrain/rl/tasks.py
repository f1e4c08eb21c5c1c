"""The toy task "shift" (rl.task="shift"), with a vocabulary of its own.

A prompt is `LENGTH` letters drawn uniformly from the alphabet "abcdefgh" followed by the
separator "=", e.g. "cafhbd="; the answer is each letter shifted by one in the alphabet,
cyclically ("dbgace"), then EOS. The reward of a completion is the fraction of the `LENGTH`
positions whose letter is right (a missing letter is wrong; letters past the answer are
ignored), so a policy that guesses uniformly earns 1/8 on average.

`ShiftTokenizer` is the task's vocabulary as a run's tokenizer (data/tokenizer.py's interface):
EOS (id 0, also padding), the 8 letters (ids 1-8) and the separator (id 9); a prompt is EOS then
its characters, as every tokenizer's `prompt` makes it.

`ShiftPrompts` generates the prompts: prompt i is drawn from numpy's generator seeded by
(seed, i), so the sequence is the same for a seed, whatever was read before, and a reader
resumes exactly from its position (`get_state`/`set_state`).
"""

import numpy as np

from pwtrain.data.tokenizer import Documents
from pwtrain.errors import ConfigError

ALPHABET = "abcdefgh"
SEPARATOR = "="
LENGTH = 6
TASKS = ("shift",)


class ShiftTokenizer(Documents):
  """EOS/pad 0, "a".."h" 1..8, "=" 9 (module doc). Encoding refuses characters outside the
  vocabulary; decoding drops EOS and ids past it."""

  eos_id = 0
  pad_id = 0
  chars = ALPHABET + SEPARATOR
  vocab_size = len(chars) + 1

  @property
  def token_bytes(self) -> np.ndarray:
    """int64[vocab_size]: one byte per character; EOS none."""
    return (np.arange(self.vocab_size) > 0).astype(np.int64)

  def encode(self, text: str | bytes) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8")
    unknown = sorted(set(text) - set(self.chars))
    if unknown:
      raise ValueError(f"{text!r} has characters outside the shift task's {self.chars!r}")
    return np.asarray([self.chars.index(c) + 1 for c in text], np.int32)

  def decode(self, ids) -> str:
    """Drops EOS and out-of-range ids (a model whose vocabulary is padded)."""
    ids = np.asarray(ids, np.int64).ravel()
    return "".join(self.chars[i - 1] for i in ids if 0 < i <= len(self.chars))


def answer(letters: str) -> str:
  """Each letter shifted by one in the alphabet, cyclically."""
  return "".join(ALPHABET[(ALPHABET.index(c) + 1) % len(ALPHABET)] for c in letters)


def shift_reward(prompt: str, completion: str, answer: str, **_) -> float:
  """The fraction of the answer's positions the completion has right (module doc)."""
  return sum(a == b for a, b in zip(completion, answer, strict=False)) / len(answer)


class ShiftPrompts:
  """The task's prompts, row i from (seed, i) (module doc): {"prompt", "answer"}."""

  def __init__(self, seed: int):
    self.seed = seed
    self.position = 0
    self.name = f"rl.task='shift' (seed {seed})"

  def row(self, index: int) -> dict:
    rng = np.random.default_rng([self.seed, index])
    letters = "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), LENGTH))
    return {"prompt": letters + SEPARATOR, "answer": answer(letters)}

  def take(self, n: int) -> list[tuple[int, dict]]:
    """The next `n` rows, each with its index."""
    rows = [(i, self.row(i)) for i in range(self.position, self.position + n)]
    self.position += n
    return rows

  def get_state(self) -> dict:
    return {"position": self.position}

  def set_state(self, state: dict) -> None:
    self.position = int(state["position"])


def tokenizer(task: str) -> ShiftTokenizer:
  """The tokenizer of `task` (one of TASKS)."""
  if task != "shift":
    raise ConfigError(f"rl.task={task!r} is not one of {TASKS} ('' reads rl.prompts)")
  return ShiftTokenizer()
