"""Remote mode's run mode: island workers launched and restarted by the supervisor, each
writing its own part of a checkpoint (backend/modes.py has the interface)."""

from collections.abc import Callable, Sequence

from pwtrain.backend.remote import supervisor
from pwtrain.backend.remote.saves import PendingSave, leaf_refs
from pwtrain.backend.remote.values import RemoteValue
from pwtrain.backend.run_mode import RunMode, results


class Remote(RunMode):
  name = "remote"

  def supervise(self, config, run_once: Callable, island_sizes: Sequence[int], workdir: str):
    return supervisor.run_remote(config, run_once, list(island_sizes), workdir)

  def part_writer(self, islands: Sequence):
    del islands
    return PendingSave

  def saveable(self, state: dict) -> dict:
    """References to the workers' arrays (each worker writes its own; nothing is fetched)."""
    if all(isinstance(v, RemoteValue) for v in state.values()):
      return {k: leaf_refs(v) for k, v in state.items()}
    return results(state)
