"""Parallelism over islands: the plan (one layout per run), the exchange strategies, and the
step programs built from them (one SPMD island in spmd.py; stages and pods in pipeline/)."""


def build_step_program(config, plan, controller, tx, schedule):
  """The compiled StepProgram (program.py) for the plan's layout."""
  from pwtrain.parallel import pipeline, spmd

  if plan.single_island:
    return spmd.build(config, plan, controller, tx, schedule)
  return pipeline.build(config, plan, controller, tx, schedule)
