"""MPMD steps over islands: pipeline stages, data-parallel pods, or both.

schedule.py orders each island's microbatches (GPipe, 1F1B, zero_bubble); pieces.py compiles a
cell's functions with named inputs, and compute.py a stage's computation among them; state.py
lays out the per-cell train states and checkpoints; builder.py compiles every cell, and wiring.py
wires the step's nodes and transfers into one Program.
"""

from pwtrain.parallel.pipeline.builder import build
from pwtrain.parallel.pipeline.schedule import (
  SCHEDULES,
  bubble,
  island_order,
  makespan,
  peak_live_inputs,
  peak_pending_weights,
  splits_backward,
)
from pwtrain.parallel.pipeline.state import PipelineProgram

__all__ = [
  "SCHEDULES",
  "PipelineProgram",
  "bubble",
  "build",
  "island_order",
  "makespan",
  "peak_live_inputs",
  "peak_pending_weights",
  "splits_backward",
]
