"""The errors a user can fix: `main` prints them as one line, with no traceback.

Every check of what the user gave (a config value or flag, a data file, the workdir) raises one
of these, naming the key or file, the value, and what would be valid or how to fix it. They
are ValueErrors, so code that catches a bad value keeps working. A storage that refuses the
run's own writes (a full disk: `WriteFailed`, and checkpoint/saving.py's `SaveFailed`) is one
line too (`storage_reason` tells such a failure from any other error, whichever library raised
it). Any other exception is a bug or a failure of the machine, and keeps its traceback.
"""

import errno
import os
import re


class UserError(ValueError):
  """Something the user gave is wrong; the message says what and how to fix it."""


class ConfigError(UserError):
  """A config value, a flag or the workdir (`--workdir`) is wrong."""


class DataError(UserError):
  """A data file, a dataset or a tokenizer file is wrong or damaged."""


class WriteFailed(UserError):
  """A file the run writes in its workdir as it trains (metrics.jsonl, TensorBoard's events,
  the config record) could not be written: the storage refused it (a full disk, a quota, a
  file size limit, an I/O error). The run stops at once (train.py adds the step it stopped at
  and its latest checkpoint, `stopped`); nothing committed is lost."""

  def __init__(self, path: str, error: OSError, message: str | None = None):
    self.path, self.error = path, error
    code = errno.errorcode.get(error.errno, error.errno) if error.errno else None
    self.reason = f"{error.strerror or error}" + (f" ({code})" if code else "")
    super().__init__(message or f"{path} could not be written: {self.reason}")

  def stopped(self, step: int, latest: int | None) -> "WriteFailed":
    """This failure's one line: the file, the OS error, where the run stopped, the checkpoint
    the same command resumes from (`latest`) and the fix."""
    kept, again = (
      (f"the latest checkpoint, step {latest}, is intact", " to resume from it")
      if latest
      else ("no checkpoint was written yet", "")
    )
    return WriteFailed(
      self.path,
      self.error,
      f"{self.path} could not be written: {self.reason}; the run stopped at step {step} and "
      f"{kept}. Free space on that filesystem (or raise its quota or file size limit) and run "
      f"the same command again{again}, or start afresh with another --workdir",
    )


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# What a full disk, a quota, a file size limit or a read-only filesystem fails a write with; a
# library that says only the OS's words for it (array_record: "write() failed: File too
# large") is recognised by them.
_STORAGE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def storage_reason(error: BaseException) -> str | None:
  """The OS error under a failed write, as "No space left on device (ENOSPC)", or None when
  `error` (or what it was raised from) is no storage failure."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    code = getattr(error, "errno", None) if isinstance(error, OSError) else None
    if code is None:
      match = _OS_ERROR_CODE.search(str(error))
      code = int(match.group(1)) if match else None
    if code is None:
      code = next((c for c in _STORAGE if os.strerror(c) in str(error)), None)
    if code:
      return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    error = error.__cause__ or error.__context__
  return None
