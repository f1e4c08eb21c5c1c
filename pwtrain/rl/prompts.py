"""Prompts from a JSONL file (rl.prompts): one JSON object per line with the prompt text in
rl.prompt_field ("prompt") and any other fields (e.g. "answer"), which the reward function is
given as keyword arguments.

The whole file is read and checked when the run starts, so a missing file, an empty one, a line
that is not a JSON object or one without the prompt field is refused at once, in one line that
names the file, the line and the fix. Blank lines are skipped. Rows are taken in file order and
start again from the first after the last (epochs); the position is the number of rows taken,
which a checkpoint keeps (`get_state`/`set_state`), so a resumed run reads the rows the
uninterrupted one would.
"""

import json
import os

from pwtrain.errors import DataError


class PromptFile:
  """The rows of a JSONL prompt file (module doc)."""

  def __init__(self, path: str, field: str = "prompt"):
    self.path = path
    self.field = field
    self.name = f"rl.prompts={path!r}"
    self.rows, self.lines = _read(path, field)
    self.position = 0

  def row(self, index: int) -> dict:
    return self.rows[index % len(self.rows)]

  def take(self, n: int) -> list[tuple[int, dict]]:
    """The next `n` rows, each with its index: the rows taken before it since the start (row i
    is the file's row i modulo their number)."""
    rows = [(i, self.row(i)) for i in range(self.position, self.position + n)]
    self.position += n
    return rows

  def line_of(self, index: int) -> int:
    """The file's line number (from 1) of row `index`."""
    return self.lines[index % len(self.rows)]

  def get_state(self) -> dict:
    return {"position": self.position}

  def set_state(self, state: dict) -> None:
    self.position = int(state["position"])


def _read(path: str, field: str) -> tuple[list[dict], list[int]]:
  """The file's rows and the line number of each."""
  where = f"rl.prompts={path!r}"
  if not os.path.isfile(path):
    raise DataError(f"{where} is not a file; set rl.prompts to a JSONL file of prompts")
  rows, lines = [], []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(
          f"{where} line {number} is not JSON ({e.msg} at column {e.colno}); make every line "
          "one JSON object"
        ) from None
      if not isinstance(row, dict):
        raise DataError(
          f"{where} line {number} is a JSON {type(row).__name__}, not an object; make every line "
          f'one JSON object such as {{"{field}": "..."}}'
        )
      if not isinstance(row.get(field), str):
        found = "is not a string" if field in row else "is missing"
        raise DataError(
          f"{where} line {number}: the prompt field {field!r} {found} (fields: "
          f"{', '.join(sorted(row)) or 'none'}); add it, or set rl.prompt_field to the field "
          "that holds the prompt"
        )
      rows.append(row)
      lines.append(number)
  if not rows:
    raise DataError(f"{where} has no prompts; write one JSON object per line, e.g. "
                    f'{{"{field}": "...", "answer": "..."}}')  # fmt: skip
  return rows, lines
