"""The errors a user can fix: `main` prints them as one line, with no traceback.

Every check of what the user gave (a config value or flag, a data file, the workdir) raises one
of these, naming the key or file, the value, and what would be valid or how to fix it. They
are ValueErrors, so code that catches a bad value keeps working. Any other exception is a bug
or a failure of the machine, and keeps its traceback.
"""


class UserError(ValueError):
  """Something the user gave is wrong; the message says what and how to fix it."""


class ConfigError(UserError):
  """A config value, a flag or the workdir (`--workdir`) is wrong."""


class DataError(UserError):
  """A data file, a dataset or a tokenizer file is wrong or damaged."""
