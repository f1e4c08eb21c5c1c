"""The interface of a run mode (backend/modes.py), and embedded mode, which is the plain case."""

from collections.abc import Callable, Sequence

from pwtrain.checkpoint import PartWriter


class RunMode:
  """Embedded mode, and the interface every mode has."""

  name = "embedded"

  def supervise(self, config, run_once: Callable, island_sizes: Sequence[int], workdir: str):
    """`run_once(config)`, started (and restarted) as the mode does it; `island_sizes` are the
    plan's, for workers a mode launches, whose logs go under the run's `workdir`."""
    del island_sizes, workdir  # the islands are this process's devices
    return run_once(config)

  def part_writer(self, islands: Sequence) -> PartWriter | None:
    del islands
    return None

  def sole_writer(self, elastic: bool) -> int | None:
    """The one process that saves checkpoints for the run, if one does (distributed mode with
    elastic pods); None: every process saves, as `part_writer` says."""
    del elastic
    return None

  def saveable(self, state: dict) -> dict:
    return results(state)


def results(state: dict) -> dict:
  """A state's values, each future waited for."""
  return {k: v.result() if hasattr(v, "result") else v for k, v in state.items()}
