"""A step that elastic pods dispatched and have not confirmed yet (steps.py): what it needs to
run again, and the metrics the trainer holds for it."""

import concurrent.futures
import dataclasses
import time

from pwtrain.harness import StepOutputs


class Metrics(concurrent.futures.Future):
  """A step's metrics as the trainer sees them: set once the step is confirmed (after it ran
  again, where it failed). Asking for the result confirms the steps up to this one."""

  def __init__(self, steps):
    """`steps`: the ElasticSteps that confirms it."""
    super().__init__()
    self._steps = steps

  def result(self, timeout=None):
    if not self.done():
      self._steps._confirm_through(self)
    return super().result(timeout)


@dataclasses.dataclass(eq=False)
class Pending:
  """A dispatched step not yet confirmed: what it needs to run again. Equal only to itself."""

  step: int  # 0-based
  batch: dict  # the whole host batch it was given
  before: dict  # the state it started from
  out: StepOutputs
  metrics: Metrics  # what the trainer was given: set once the step is confirmed
  dispatched_at: float = dataclasses.field(default_factory=time.perf_counter)  # its start
