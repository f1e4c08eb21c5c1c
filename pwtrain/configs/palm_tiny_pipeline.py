"""palm_tiny as a 4-stage pipeline: 4 islands of 2 devices, data parallel inside each island.

Run:
  python -m pwtrain.main --config=palm_tiny_pipeline --workdir=/tmp/pwtrain_pipe

Each stage (one of the 4 layers; the embedding on the first stage, the output layer on the last,
sharing the embedding matrix) runs on its own island; 8 microbatches of 2 sequences flow through
the stages in a 1F1B schedule, dispatched by the single controller one whole step at a time.
Same model, data and optimizer as palm_tiny, so the loss curve matches it (to float rounding).
Try --config.parallel.schedule=gpipe, or --config.parallel.tensor=2 --config.parallel.data=1.
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.parallel.islands = 4
  c.parallel.stages = 4
  c.parallel.data = -1
  c.parallel.schedule = "1f1b"
  c.train.num_microbatches = 8
  c.lock()
  return c
