"""The contract between a parallel layout and the trainer: a StepProgram.

Every layout (one SPMD island in spmd.py; stages and pods over islands in pipeline/) builds an
object with these members, and the trainer, the harness, the tests and the benchmarks use only
them. The program's inputs are the state values (under `state_keys`) plus `feed(batch)`; its
outputs are the next state values (same keys) and "metrics". Checkpoints always hold the
whole-model state (`to_checkpoint`), its layers unrolled (`params/blocks/<i>`) even when the
program's model scans them (model.scan_layers, docs/architecture.md), so any layout restores any
other layout's checkpoint.
"""

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from pwtrain.backend import Program


@runtime_checkable
class StepProgram(Protocol):
  abstract_state: (
    dict  # whole-model state (unrolled), ShapeDtypeStructs with shardings: restore target
  )
  init: Callable[[], dict]  # () -> {state key: state}, computed on the islands
  executables: dict  # every compiled piece, for inspection (memory analysis, tests)
  exchange_bytes: int  # bytes one pod sends to the others per (outer) step; 0 for one pod

  @property
  def state_keys(self) -> tuple[str, ...]: ...

  def program_for(self, step: int) -> Program:
    """The program that runs step `step` (0-based)."""
    ...

  @property
  def eval_program(self) -> Program:
    """The forward-only program, compiled on first use: its inputs are the state values and
    `feed(batch)`, as a step's (nothing is donated); its outputs "eval/<i>" are partial sums
    {"ce_sum", "z_sum", "tokens"} (step.EVAL_KEYS) whose total is the batch's."""
    ...

  def feed(self, batch: dict) -> dict:
    """A host batch (the objective's columns: {"inputs", "targets"} for "lm", plus
    "advantages" and "behavior_logprobs" for "grpo"; objectives.py) -> the program's batch
    inputs."""
    ...

  def feed_rows(self, num_rows: int) -> dict[str, range]:
    """For each batch input `feed` makes from a batch of `num_rows` rows: the rows it takes."""
    ...

  def to_checkpoint(self, state: dict) -> dict:
    """The program's state values -> the whole-model train state, layers unrolled."""
    ...

  def from_checkpoint(self, whole: dict) -> dict:
    """A whole-model train state (as restored into `abstract_state`) -> the program's state."""
    ...
