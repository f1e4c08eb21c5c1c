"""The launcher's log of each process's output (pwtrain/launch.py): <log dir>/process<i>.log.

A write the storage refuses (a full disk, a quota, a file size limit, an I/O error: any OSError)
is kept as `failed`: the one line (`errors.WriteFailed`'s, naming the file, and the fix) that
the launcher prints as it stops the run (as on a process's death, but not restarted).
The logs are written no more, and the lines still go on to the console where they go there, so
that no process blocks on a pipe nobody reads (were the error to end the launcher's echo thread,
a process whose pipe filled would block for good).
"""

import contextlib
import os

from pwtrain.errors import WriteFailed


class ProcessLogs:
  def __init__(self, log_dir: str, n: int, mode: str):
    """Opens the log of each of `n` processes in `log_dir` with `mode` ("w" afresh, "a" to go
    on)."""
    self.paths = [os.path.join(log_dir, f"process{i}.log") for i in range(n)]
    self._files = [open(path, mode) for path in self.paths]  # noqa: SIM115 - closed by `close`
    self.failed: str | None = None  # the first write refused, said in one line

  def append(self, i: int, text: str) -> None:
    """Appends `text` to process `i`'s log, flushed (nothing once a write failed)."""
    if self.failed is not None:
      return
    try:
      self._files[i].write(text)
      self._files[i].flush()
    except OSError as e:
      self.failed = (
        f"{WriteFailed(self.paths[i], e)}; stopping the run, its latest checkpoint kept. Free "
        "space on that filesystem (or give another --log_dir) and run the same command again to "
        "resume"
      )

  def close(self) -> None:
    for file in self._files:  # after a failed write, what it could not write is lost
      with contextlib.suppress(OSError) if self.failed else contextlib.nullcontext():
        file.close()
