"""`train.profile_steps=(start, stop)`: a `jax.profiler` trace of those steps.

The trace covers the steps numbered start+1 .. stop (step numbers as logged: step k is the k-th
optimizer step), written under `<workdir>/profile/` in the TensorBoard profile plugin's layout
(`tensorboard --logdir <workdir>/profile`, or XProf). Every computation and transfer the
controller launches is annotated with its program node's name ("train_step", "0:F1.3", ...), so
the trace shows which node each device computation belongs to. () or an empty range: no trace.

The profile is diagnostics: a write of it that the storage refuses (a full disk, a quota, a file
size limit: `errors.storage_reason`) is one warning line, its partial files are removed, and the
run goes on.
"""

import logging
import os
import shutil

import jax

from pwtrain.errors import ConfigError, storage_reason

log = logging.getLogger(__name__)


class StepProfiler:
  def __init__(self, workdir: str, steps):
    steps = tuple(steps or ())
    if steps and (len(steps) != 2 or not 0 <= steps[0] < steps[1]):
      raise ConfigError(
        f"train.profile_steps={steps} must be (start, stop) with 0 <= start < stop, or ()"
      )
    self.start, self.stop = steps if steps else (None, None)
    self.directory = os.path.join(workdir, "profile")
    self.active = False
    self._before: set[str] | None = None  # the traces under `directory` when this one began

  def before_step(self, step: int) -> None:
    """Called before dispatching step `step` + 1 (the trace starts after `start` steps)."""
    if self.start is not None and step == self.start and not self.active:
      self._before = self._traces()
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_step(self, step: int, wait) -> None:
    """Called once step `step` (1-based) is dispatched; `wait()` blocks until it has run."""
    if self.active and step >= self.stop:
      wait()  # the traced steps' device work must be inside the trace
      if self.close():
        log.info("profile of steps %d-%d in %s", self.start + 1, self.stop, self.directory)

  def close(self) -> bool:
    """Ends a trace in progress and writes it; whether one was written. A write the storage
    refuses is one warning: the trace's files are removed and the run goes on."""
    if not self.active:
      return False
    self.active = False
    try:
      jax.profiler.stop_trace()
    except RuntimeError as e:
      reason = storage_reason(e)
      if reason is None:
        raise
      self._discard()
      log.warning(
        "the profile of steps %d-%d could not be written to %s: %s; the run goes on without "
        "it. Free space on that filesystem, or set train.profile_steps=() to profile nothing",
        self.start + 1, self.stop, self.directory, reason,
      )  # fmt: skip
      return False
    return True

  def _traces(self) -> set[str] | None:
    """The trace directories under `directory` (jax.profiler writes each trace to
    plugins/profile/<time>/); None when `directory` does not exist."""
    if not os.path.isdir(self.directory):
      return None
    runs = os.path.join(self.directory, "plugins", "profile")
    return set(os.listdir(runs)) if os.path.isdir(runs) else set()

  def _discard(self) -> None:
    """After a failed write: what the trace wrote removed, and jax.profiler ready for another
    (its stop_trace forgets a session only once the session's files are written, and would
    refuse every later start_trace in this process, a restart's or a rollback's)."""
    from jax._src import profiler as jax_profiler

    jax_profiler._profile_state.reset()
    if self._before is None:
      shutil.rmtree(self.directory, ignore_errors=True)
      return
    for name in self._traces() - self._before:
      shutil.rmtree(os.path.join(self.directory, "plugins", "profile", name), ignore_errors=True)
