"""Parallelism over islands: the plan (one layout per run), the exchange strategies, and the
step programs built from them (one SPMD island in spmd.py; stages and pods in pipeline/)."""


def build_step_program(config, plan, controller, tx, schedule, objective):
  """The compiled StepProgram (program.py) for the plan's layout, minimising `objective`
  (objectives.make)."""
  from pwtrain.parallel import pipeline, spmd

  if plan.single_island:
    return spmd.build(config, plan, controller, tx, schedule, objective)
  return pipeline.build(config, plan, controller, tx, schedule, objective)
