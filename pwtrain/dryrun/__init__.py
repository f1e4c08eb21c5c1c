"""The dry run: a config's plan, memory per device and step time on its configured cluster,
with no devices (`python -m pwtrain.main --config=... --dry_run`).

hardware.py is the cluster's hardware (presets and `config.hardware` overrides); shapes.py the
train state's shapes and each device's bytes of it; inputs.py what the cost model reads
(`Setup`); estimate.py the cost model (`estimate`: the numbers); report.py their printout
(`report`). The layout and the exchange's behaviour come from the run's Plan
(parallel/plan.py) and the model's arithmetic, what a block keeps and recomputes under each
`model.remat` policy included, from models/arithmetic.py, so the dry run plans exactly what a
run would, with the run's own remat and microbatches.
"""

from pwtrain.dryrun.estimate import PIPELINE_RECOMPUTE, REMAT_BY_MEMORY, estimate
from pwtrain.dryrun.hardware import DEFAULT_EFFICIENCY, HARDWARE, Hardware, hardware
from pwtrain.dryrun.report import fits_text, report, size_text
from pwtrain.dryrun.shapes import (
  abstract_state,
  build_plan,
  model_fns,
  padded_vocab_size,
  shard_bytes,
  tree_bytes,
)

__all__ = [
  "DEFAULT_EFFICIENCY",
  "HARDWARE",
  "PIPELINE_RECOMPUTE",
  "REMAT_BY_MEMORY",
  "Hardware",
  "abstract_state",
  "build_plan",
  "estimate",
  "fits_text",
  "hardware",
  "model_fns",
  "padded_vocab_size",
  "report",
  "shard_bytes",
  "size_text",
  "tree_bytes",
]
