"""Run modes as objects: how a run is supervised and how its train state is saved.

The trainer asks its mode, never `backend.mode`:

  embedded     one process owns every device (also Pathways on Cloud, whose IFRT proxy shows
               every slice to this one process). Saves the state whole.
  distributed  JAX's own runtime, islands are processes. Each island's processes write its part
               of a checkpoint (checkpoint.ProcessParts), unless one island spans them all.
  remote       one controller drives gRPC island workers (backend/remote/mode.py): workers are
               launched and restarted by its supervisor, and each writes its own part.

`supervise(config, run_once, island_sizes)` runs `run_once(config)` (one start of the job, which
lays out its cluster itself) as the mode needs it run; `part_writer(islands)` is the
checkpoint.PartWriter for a state on those islands (None: saved whole); `saveable(state)` is
what a checkpoint takes of the step program's whole-model state (backend/run_mode.py).
"""

from collections.abc import Sequence

import jax

from pwtrain.backend.run_mode import RunMode
from pwtrain.checkpoint import PartWriter, ProcessParts


class Distributed(RunMode):
  name = "distributed"

  def part_writer(self, islands: Sequence) -> PartWriter | None:
    # One island over every process (plan.check_placement): Orbax's own multi-process save.
    if jax.process_count() == 1 or len(islands) == 1:
      return None
    return ProcessParts

  def sole_writer(self, elastic: bool) -> int | None:
    """Elastic pods: process 0, whose pod 0 holds the whole model's replica (the pods are
    data-parallel, drills.check) and which reads every data stream, saves alone (checkpoint/
    managers.py), so that no save waits for a process that may die meanwhile."""
    return 0 if elastic and jax.process_count() > 1 else None


def for_backend(backend) -> RunMode:
  """The mode of the config's `backend` section (backend.mode, checked by config.validate)."""
  if backend.mode == "remote":
    from pwtrain.backend.remote.mode import Remote  # grpc: the [remote] extra

    return Remote()
  return Distributed() if backend.mode == "distributed" else RunMode()
