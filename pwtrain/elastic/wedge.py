"""The drill `wedge:pod<P>@step<N>` (`fault.inject`): pod P's islands run a computation that
never ends, sent as any program is (Controller.run), so their execution makes no progress while
their processes stay alive and answer. Remote mode: the worker's execution queue runs it, its
server answers Health, and the health monitor declares it lost once the op has run past
`fault.progress_timeout_s` (backend/remote/client.py's Monitor), kills it and the supervisor
relaunches it. Distributed mode: every process sends the program (so that they count programs
alike) and the pod's process runs it; its progress check (pwtrain/liveness.py) ends it once the
computation has run past `fault.progress_timeout_s`, and pwtrain.launch starts it again. Nothing
else finds it: the drill exercises those rules for real. Embedded mode refuses the drill
(drills.check): nothing ends a wedged computation of the controller's own process.
"""

import logging

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain.backend.program import Node, Program

log = logging.getLogger(__name__)


def forever(x):
  """A computation that never ends, which XLA cannot fold: `x` (zeros) stays >= 0 as 1 is added
  to it again and again (a large float32 plus 1 is itself)."""
  return jax.lax.while_loop(lambda c: c[0] >= 0, lambda c: c + 1.0, x)


def wedge(controller, islands, drill: str) -> None:
  """Sends `forever` to each of `islands` (cluster.Island) as a program of its own, after the
  work already sent there; returns at once (every process of a distributed run calls it).
  `drill`: the drill's text, for the log line."""
  for island in islands:
    mesh = island.mesh({"wedge": island.num_devices})
    replicated = NamedSharding(mesh, PartitionSpec())
    arg = jax.ShapeDtypeStruct((1,), np.float32, sharding=replicated)
    exe = controller.compile(
      "wedge", forever, island.name, (arg,), mesh=mesh, out_shardings=replicated
    )
    program = Program(nodes=(Node("wedge", exe, ("x",)),), outputs={"x": ("wedge", 0)})
    controller.run(program, {"x": np.zeros(1, np.float32)})
    if controller.runs_here(island.name):
      log.warning(
        "fault.inject %s: island %s runs a computation that never ends", drill, island.name
      )
