"""What every part of the dry run's cost model (estimate.py) reads: `Setup`, made by `setup`
from a config: its hardware, the run's plan on virtual islands, the model's shape-only fns and
the abstract whole-model train state."""

import dataclasses
import math

from pwtrain import objectives, optim
from pwtrain import step as step_lib
from pwtrain.dryrun import shapes
from pwtrain.dryrun.hardware import Hardware, hardware
from pwtrain.parallel import pipeline
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel.stages import Stage


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every part of the estimate reads: the config, its hardware, its plan, the model's
  shape-only fns and the abstract whole-model train state (the plan's exchange's included)."""

  config: object
  hw: Hardware
  plan: plan_lib.Plan
  fns: step_lib.ModelFns
  whole: dict

  @property
  def bubble(self) -> float:
    """The step over one island's work under the schedule, counted from it (1 for one stage:
    parallel/pipeline/schedule.bubble)."""
    if self.plan.num_stages == 1:
      return 1.0
    c = self.config
    stages = list(self.plan.stages)
    return pipeline.bubble(
      c.parallel.schedule, stages, c.train.num_microbatches, self.plan.virtual_stages
    )

  @property
  def devices_per_island(self) -> int:
    return self.plan.islands[0].num_devices

  @property
  def stages_recompute(self) -> bool:
    """Whether a pipeline stage's B piece recomputes its forward (parallel.stage_remat="full")."""
    return self.plan.num_stages > 1 and self.config.parallel.stage_remat == "full"

  @property
  def hosts_per_island(self) -> int:
    return math.ceil(self.devices_per_island / self.hw.devices_per_host)

  def tokens_per_device(self, num_micro: int) -> int:
    """Tokens one device processes per microbatch at `num_micro` microbatches."""
    train, p = self.config.train, self.plan
    return (
      train.global_batch // p.num_pods // num_micro // p.batch_shards * self.config.data.seq_len
    )


def setup(config) -> Setup:
  plan = shapes.build_plan(config)
  tx, _ = optim.build(config.optim, config.train.num_steps)
  fns = shapes.model_fns(config.model, config.moe)
  reference = objectives.holds_reference(config)
  whole = shapes.abstract_state(fns, tx, config.seed, plan.exchange, reference)
  return Setup(config, hardware(config), plan, fns, whole)


def island_stages(plan: plan_lib.Plan) -> dict[str, list[Stage]]:
  """Pod 0's islands, each with the cells (stages, or exchange chunks) placed on it."""
  islands = {}
  for stage in plan.stages:
    islands.setdefault(plan.cells[(0, stage.index)].name, []).append(stage)
  return islands
