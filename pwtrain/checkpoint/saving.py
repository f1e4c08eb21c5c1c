"""A save that the storage refused: which errors those are, and the one line that says so.

A checkpoint's files are written by TensorStore (array data, in C++) and by Orbax and pwtrain
(metadata, in Python). A full disk, a quota, a file size limit or a read-only filesystem fails
the write either way: as an OSError, or as a TensorStore error whose text carries the OS error
code (`... Failed to write 1010841 bytes to file 12: File too large [os_error_code='27']`).
`storage_reason` (pwtrain/errors.py) finds that OS error; any other error of a save (a bug, ours
or a library's) is not a storage failure and keeps its traceback.
"""

import os
import shutil
import threading

from pwtrain.checkpoint import quiet
from pwtrain.checkpoint.integrity import one_line
from pwtrain.errors import UserError, storage_reason


class SaveFailed(UserError):
  """A checkpoint could not be written: the storage refused it (`storage_reason`). The run
  stops at once; the checkpoints committed before it are intact."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def save_failed(step: int, directory: str, reason: str, latest: int | None) -> SaveFailed:
  """The one line of a save of `step` into `directory` that failed with the OS error
  `reason`, naming the checkpoint a new run resumes from (`latest`) and the fix."""
  kept = f"the latest checkpoint, step {latest}, is intact" if latest else "no checkpoint is kept"
  return SaveFailed(
    f"checkpoint {step} could not be written to {directory}: {reason}; the run stopped here "
    f"and {kept}. Free space on that filesystem (or raise its quota or file size limit) and "
    "run the same command again to resume from it",
    step,
  )


class InFlight:
  """One save from its start until it is seen finished: what Orbax logs meanwhile is held
  (`quiet.FAILURES`), released if it succeeds, dropped if it fails for want of storage, when
  `SaveFailed` says it in one line instead."""

  def __init__(self, manager, directory: str, step: int):
    """`manager`: the directory's Orbax CheckpointManager."""
    self.manager, self.directory, self.step = manager, directory, step
    # A save in parts (checkpointer.py) is committed by a thread of its own, which sets
    # `error` when it fails; others by the manager's own (Orbax's "finalize" thread).
    self.commit: threading.Thread | None = None
    self.error: BaseException | None = None
    quiet.FAILURES.hold()

  def _thread(self):
    return self.commit or self.manager._finalize_thread.get()

  def running(self) -> bool:
    """Whether the save is still being written (never waits)."""
    thread = self._thread()
    return thread is not None and thread.is_alive()

  def finish(self) -> None:
    """Waits for the save; its failure raised (`failed`)."""
    if self.commit is not None:
      self.commit.join()
      if self.error is not None:
        self.failed(self.error)
      return self.succeeded()
    finalize = self.manager._finalize_thread.get()
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - a storage failure becomes one line, others raised
      if finalize is not None:
        finalize.exception = None  # raised here once: Orbax's later waits do not raise it
      self.failed(e)
    self.succeeded()

  def succeeded(self) -> None:
    quiet.FAILURES.release()

  def failed(self, error: BaseException):
    """Raises `SaveFailed` when `error` is a storage failure (Orbax's notices of it dropped,
    its temporary directory removed), else `error` itself."""
    reason = storage_reason(error)
    if reason is None:
      quiet.FAILURES.release()
      raise error
    quiet.FAILURES.drop()
    for name in os.listdir(self.directory):  # the failed step's temporary directory, if any
      if name.startswith(f"{self.step}.orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    self.manager.reload()
    raise save_failed(self.step, self.directory, reason, self.manager.latest_step()) from None


def start_refused(error: BaseException, workdir: str) -> UserError | None:
  """What a start that failed before its first step with `error` says, as a UserError (one
  line) where the workdir's storage refused a write (a full disk: `storage_reason`); None for
  any other error (a UserError already says it; a bug keeps its traceback)."""
  reason = None if isinstance(error, UserError) else storage_reason(error)
  if reason is None:
    return None
  return UserError(
    f"a write under --workdir={workdir} failed: {reason} ({one_line(error)}); nothing was "
    "left of this start in it. Free space on that filesystem (or raise its quota or file size "
    "limit) and run again"
  )
