"""`train.profile_steps=(start, stop)`: a `jax.profiler` trace of those steps.

The trace covers the steps numbered start+1 .. stop (step numbers as logged: step k is the k-th
optimizer step), written under `<workdir>/profile/` in the TensorBoard profile plugin's layout
(`tensorboard --logdir <workdir>/profile`, or XProf). Every computation and transfer the
controller launches is annotated with its program node's name ("train_step", "0:F1.3", ...), so
the trace shows which node each device computation belongs to. () or an empty range: no trace.
"""

import logging
import os

import jax

from pwtrain.errors import ConfigError

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

  def before_step(self, step: int) -> None:
    """Called before dispatching step `step` + 1 (the trace starts after `start` steps)."""
    if self.start is not None and step == self.start and not self.active:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_step(self, step: int, wait) -> None:
    """Called once step `step` (1-based) is dispatched; `wait()` blocks until it has run."""
    if self.active and step >= self.stop:
      wait()  # the traced steps' device work must be inside the trace
      self.close()
      log.info("profile of steps %d-%d in %s", self.start + 1, self.stop, self.directory)

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
