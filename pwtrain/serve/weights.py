"""Where the served weights are: a layout of cells (a model, or a pipeline stage of it, on an
island, its weights published there under a name), and the two sources of one.

  attached     `LiveWeights`: the training run's own parameters, read in place. The run's
               controller publishes each train state as the node that produces it launches
               (Controller.start_publishing; remote: as it runs on the worker), so a serving
               node placed on the island's queue reads the state of the latest step launched
               before it, and the next step, which donates that state, launches after it
               (backend/scheduler.py; remote/ordered.py). The served pod is
               the last whose islands are all live: its cells, in layer order (one cell on one
               island; a pipeline's stages, or the interleaved schedule's chunks, over theirs).
               Nothing is copied.
  standalone   `CheckpointWeights`: a run's latest checkpoint restored onto one island of this
               machine as `pwtrain.sample` restores it (pwtrain/inference.py), published there,
               and with serve.reload a newer checkpoint restored and published when one appears
               (polled every serve.reload_poll_s seconds). Requests being served move to the new
               weights at their next token, as attached ones move to each new step's.

What is published is a train state, or a dict with at least {"params", "step"}: serving reads
those two entries (program.Latest), and names every response by the step.
"""

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pwtrain import inference
from pwtrain import step as step_lib
from pwtrain.backend import Cluster, Controller, Island
from pwtrain.parallel import spmd
from pwtrain.parallel.pipeline.state import state_key
from pwtrain.parallel.stages import Stage

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Cell:
  """A part of the served model on one island: `fns` (the whole model, or one stage's layers)
  with its weights published on `island` under `name`, laid out on `mesh` as `shardings` says
  ({"params", "step"})."""

  name: str
  island: str
  mesh: Mesh
  fns: step_lib.ModelFns
  shardings: dict
  first: bool  # has the embedding: takes token ids
  last: bool  # has the head: gives logits


@dataclasses.dataclass(frozen=True)
class Layout:
  """The served model's cells in layer order; `key` tells layouts apart (pieces are compiled
  once per layout)."""

  cells: tuple[Cell, ...]
  key: tuple

  @property
  def islands(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c.island for c in self.cells))


class NoLivePod(RuntimeError):
  """Every pod has a lost island: nothing can serve until one runs again."""


def make_cell(config, name: str, island: str, mesh: Mesh, stage: Stage | None) -> Cell:
  """A cell of `stage`'s layers (None: the whole model), its weights sharded as training shards
  them (spmd.state_shardings, the rule every layout uses)."""
  kwargs = stage.model_kwargs() if stage is not None else {}
  fns = step_lib.model_fns(config.model, config.moe, **kwargs)
  abstract = {"step": jax.ShapeDtypeStruct((), np.int32), "params": fns.abstract_params}
  shardings = spmd.state_shardings(fns, mesh, abstract)
  first = stage is None or stage.first
  last = stage is None or stage.last
  return Cell(name, island, mesh, fns, shardings, first, last)


class LiveWeights:
  """The training run's parameters in place (see the module doc). `current()`: the harness
  that runs the steps now (elastic pods change it when the live pods change)."""

  def __init__(self, config, controller: Controller, current: Callable):
    self.config = config
    self.controller = controller
    self._current = current
    self._layouts: dict[tuple, Layout] = {}

  def start(self, state: dict) -> None:
    """Publishes the state the run starts from (its init or restored state) before the first
    step; every step's state is published as it launches from then on. Remote: a state still
    on the trainer's host is not published (its first step uploads it, and that step's state is
    the first served)."""
    self.controller.start_publishing()
    plan = self._current().plan
    for cell, island in plan.cells.items():
      name = _name(plan, cell)
      if name in state:
        self.controller.publish(island.name, name, state[name])

  def layout(self) -> Layout:
    """The cells of the last pod whose islands are all live, in the current plan (pod 0, which
    reports the metrics and is the first to take a lost pod's work, is served from last)."""
    plan = self._current().plan
    lost = set(self.controller.lost)
    for pod in reversed(range(plan.num_pods)):
      cells = [(pod, s) for s in range(plan.num_stages)]
      if not any(plan.cells[c].name in lost for c in cells):
        break
    else:
      raise NoLivePod(f"every pod has a lost island: {sorted(lost)}")
    return self._layout(plan, pod)

  def spares(self) -> tuple[Layout, ...]:
    """The layouts of the other pods whose islands are all live, in the current plan: the ones
    serving may move to when the served pod is lost. The engine builds their pieces ahead, so
    that a failover compiles nothing (a lost pod's work is hosted on the same plan)."""
    plan = self._current().plan
    lost = set(self.controller.lost)
    served = self.layout().key
    live = [
      pod
      for pod in range(plan.num_pods)
      if not any(plan.cells[(pod, s)].name in lost for s in range(plan.num_stages))
    ]
    return tuple(x for x in (self._layout(plan, p) for p in live) if x.key != served)

  def _layout(self, plan, pod: int) -> Layout:
    key = (id(plan), pod)
    if key not in self._layouts:
      cells = [(pod, s) for s in range(plan.num_stages)]
      made = tuple(
        make_cell(self.config, _name(plan, c), plan.cells[c].name, plan.mesh(c), plan.stages[c[1]])
        for c in cells
      )
      self._layouts[key] = Layout(made, key)
    return self._layouts[key]

  def close(self) -> None:
    pass


def _name(plan, cell: tuple) -> str:
  """The name the step program gives cell's state (parallel/spmd.py, pipeline/state.py)."""
  return "state" if plan.single_island else state_key(cell)


class CheckpointWeights:
  """A run's latest checkpoint on one island of this machine (see the module doc); builds the
  island's cluster and controller, which the caller closes with this source."""

  NAME = "weights"

  def __init__(self, config, workdir: str, *, reload: bool, poll_s: float):
    self.config = config
    self.workdir = workdir
    self.mesh = inference.reading_mesh(config)
    island = Island("serve", tuple(self.mesh.devices.flat))
    self.cluster = Cluster((island,))
    self.controller = Controller(self.cluster, max_inflight=0)
    self._layout = Layout((make_cell(config, self.NAME, island.name, self.mesh, None),), ("serve",))
    self.step = self._publish()
    self._stop = threading.Event()
    self._thread = None
    if reload:
      self._thread = threading.Thread(
        target=self._poll, args=(poll_s,), name="serve-reload", daemon=True
      )
      self._thread.start()

  def layout(self) -> Layout:
    return self._layout

  def spares(self) -> tuple[Layout, ...]:
    return ()  # one island

  def _publish(self) -> int:
    """Restores the latest readable checkpoint and publishes it; its step."""
    step, _, params = inference.restore_params(self.config, self.workdir, self.mesh)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    value = {"params": params, "step": jax.device_put(np.int32(step), replicated)}
    self.controller.publish(self._layout.cells[0].island, self.NAME, value).result()
    return step

  def _poll(self, poll_s: float) -> None:
    """Every `poll_s` seconds: a newer checkpoint restored and published. A reload that fails
    (a checkpoint being written or removed, a damaged one, a bug) is said in one line, once per
    distinct failure, and tried again at the next poll; the last good weights stay served."""
    said = None
    while not self._stop.wait(poll_s):
      try:
        latest = inference.latest_step(self.workdir)
        if latest is not None and latest > self.step:
          self.step = self._publish()
          log.info("serving the weights of checkpoint %d", self.step)
        said = None
      except Exception as e:  # noqa: BLE001 - said, and the thread goes on serving
        failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if failure != said:
          log.warning(
            "reloading %s failed (%s); still serving checkpoint %d, trying again every %g s",
            os.path.join(self.workdir, "checkpoints"), failure, self.step, poll_s,
          )  # fmt: skip
        said = failure

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self.controller.close()
