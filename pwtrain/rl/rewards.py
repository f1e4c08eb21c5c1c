"""Reward functions (rl.reward): a built-in by name, or any Python function as "module:function"
(the module importable from the run's Python path, e.g. a file `my_rewards.py` in the
directory the run starts from).

A reward function is called once per completion as

    reward = f(prompt, completion, **fields)

with the prompt text, the completion's text (decoded from the sampled ids, EOS dropped) and the
prompt row's other fields (a JSONL row's, or the task's: {"answer"}), and returns a number (an
int, a float or a bool). A function that raises, returns something else, or returns NaN or an
infinity stops the run with one line (`RewardError`) that names the function and the row, before
the step that would have used it: the checkpoints written so far stay as they are.

Built-ins:
  exact_match   1.0 if the completion, stripped of surrounding whitespace, equals the row's
                `answer` (as a string, stripped), else 0.0
  last_number   1.0 if the last number in the completion (an optional sign, digits, an optional
                decimal part; commas between digits ignored) equals the row's `answer` as a
                number, else 0.0 (also when the completion has no number)
  shift         the toy task's: the fraction of the answer's positions right (tasks.py)
"""

import importlib
import math
import numbers
import re
from collections.abc import Callable

from pwtrain.errors import ConfigError, UserError
from pwtrain.rl import tasks

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


class RewardError(UserError):
  """A reward function failed on a row, or returned something that is not a finite number."""


def exact_match(prompt: str, completion: str, answer, **_) -> float:
  return float(completion.strip() == str(answer).strip())


def last_number(prompt: str, completion: str, answer, **_) -> float:
  found = _NUMBER.findall(completion)
  if not found:
    return 0.0
  try:
    expected = float(str(answer).replace(",", ""))
  except ValueError:
    return 0.0
  return float(float(found[-1].replace(",", "")) == expected)


BUILT_IN = {"exact_match": exact_match, "last_number": last_number, "shift": tasks.shift_reward}


def load(spec: str) -> Callable:
  """The function `spec` names: a built-in's name or "module:function"."""
  if spec in BUILT_IN:
    return BUILT_IN[spec]
  module_name, colon, name = spec.partition(":")
  if not colon or not module_name or not name:
    raise ConfigError(
      f"rl.reward={spec!r} is neither a built-in ({', '.join(BUILT_IN)}) nor 'module:function'"
    )
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(
      f"rl.reward={spec!r}: module {module_name!r} cannot be imported ({e}); put it on the "
      "Python path (e.g. the directory the run starts from)"
    ) from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ConfigError(f"rl.reward={spec!r}: {module_name} has no function {name!r}")
  return fn


class Reward:
  """The run's reward function (`load(spec)`), checked on every call (module doc)."""

  def __init__(self, spec: str):
    self.spec = spec
    self.fn = load(spec)

  def __call__(self, prompt: str, completion: str, fields: dict, where: str) -> float:
    """The reward of one completion; `where` names its row for the error line."""
    try:
      value = self.fn(prompt, completion, **fields)
    except Exception as e:  # noqa: BLE001 - any failure of the user's function is one line
      raise RewardError(
        f"rl.reward={self.spec!r} raised {type(e).__name__}: {_first_line(e)} on {where} "
        f"(prompt {_short(prompt)}, completion {_short(completion)}); fix the function"
      ) from None
    if isinstance(value, bool):
      return float(value)
    if not isinstance(value, numbers.Real):
      raise RewardError(
        f"rl.reward={self.spec!r} returned {_short(value)} ({type(value).__name__}), not a number, "
        f"on {where} (prompt {_short(prompt)}); return an int or a float"
      )
    value = float(value)
    if not math.isfinite(value):
      raise RewardError(
        f"rl.reward={self.spec!r} returned {value} on {where} (prompt {_short(prompt)}, "
        f"completion {_short(completion)}); return a finite number"
      )
    return value


def _short(value, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else "(no message)"
