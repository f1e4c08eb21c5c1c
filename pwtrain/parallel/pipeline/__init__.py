"""MPMD steps over islands: pipeline stages, data-parallel pods, or both.

schedule.py orders each island's microbatches (GPipe, 1F1B); pieces.py compiles a cell's
functions with named inputs; state.py lays out the per-cell train states and checkpoints;
builder.py compiles every cell and wires the step's nodes and transfers into one Program.
"""

from pwtrain.parallel.pipeline.builder import build
from pwtrain.parallel.pipeline.schedule import SCHEDULES, island_order, peak_live_inputs
from pwtrain.parallel.pipeline.state import PipelineProgram

__all__ = ["SCHEDULES", "PipelineProgram", "build", "island_order", "peak_live_inputs"]
