"""Parallelism: logical-axis sharding, the plan of islands and meshes."""


def build_step_program(config, plan, controller, tx, schedule):
  """The compiled step for the plan's layout: one SPMD island, or stages/pods over islands."""
  from pwtrain.parallel import pipeline, spmd

  if config.parallel.stages > 1 or config.parallel.pods > 1:
    return pipeline.build(config, plan, controller, tx, schedule)
  return spmd.build(config, plan, controller, tx, schedule)
