"""palm_tiny on two pods: 2 islands of 4 devices, each a data-parallel replica (PaLM's setup).

Run:
  python -m pwtrain.main --config=palm_tiny_2pods --workdir=/tmp/pwtrain_2pods

The controller sends half of each global batch to each pod; each pod computes its gradients with
its own 4-device mesh, the pods exchange gradients across islands and sum them in the same order,
and both apply the same update, so their parameters stay bitwise identical. The loss curve
matches palm_tiny (to float rounding). Try --config.exchange.mode=overlapped (gradients sent per
chunk of layers during the backward pass) or --config.exchange.compression=bf16|int8.
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.parallel.islands = 2
  c.parallel.pods = 2
  c.parallel.data = -1
  c.exchange.mode = "sync"
  c.lock()
  return c
