"""The exchange strategy: how pods (data-parallel replicas on their own islands) combine work.

`Exchange` itself is the one-pod case: nothing crosses pods and every hook is a no-op. Each mode
(sync.py, overlapped.py, stale.py, diloco.py) is a subclass in its own file that overrides the
hooks it needs; `pwtrain.parallel.exchange.make` builds the one instance a run uses, and the
plan, the step builder and the dry run all read that instance:
  layout      `cells_per_pod`: how many cells (islands' shares) a pod's model is cut into
  state       `init_state`: what the mode carries in the train state; `per_pod_state`: whether
              the pods' states differ (then checkpoints hold every pod's)
  update      `wrap_update`, `update`: the optimizer step a cell applies
  step        `compile_cell`, `gradient_nodes`, `apply_inputs`, `apply_refs`, `outer_nodes`:
              the mode's compiled pieces and the nodes and transfers it adds to the step
  cost        `bytes_per_step`, `received_copies`, `exposed_s`: what the dry run counts
The step builder's side of these hooks is pipeline/wiring.py (`ProgramBuilder`) and
pipeline/pieces.py (`CellPieces`).
"""

import jax.numpy as jnp

from pwtrain import objectives

MODES: dict[str, type] = {}  # exchange.mode -> its class, filled as the mode modules load


class Exchange:
  """One pod: nothing to exchange. A subclass with a `mode` is registered under it."""

  mode = "none"
  per_pod_state = False  # the pods' train states differ: checkpoints hold every pod's
  program_kinds = ("step",)  # the step programs the mode runs (see program_kind)

  def __init_subclass__(cls, **kw):
    super().__init_subclass__(**kw)
    assert cls.mode not in MODES, f"exchange mode {cls.mode!r} defined twice"
    MODES[cls.mode] = cls

  def __init__(self, config):
    self.cfg = config.exchange
    self.num_pods = config.parallel.pods
    self.compression = "none" if self.num_pods == 1 else self.cfg.compression
    self.objective = objectives.make(config)  # how the pods' statistics merge

  @classmethod
  def validate(cls, cfg) -> None:
    """Errors for `exchange.*` settings this mode cannot honour (naming key and value)."""

  # -- layout ---------------------------------------------------------------------------------

  def cells_per_pod(self, num_stages: int, num_layers: int) -> int:
    """How many cells (each with its own state and pieces) one pod's model is cut into;
    `num_layers` counts what cells are cut from (scanned MoE layers: periods, stages.num_units)."""
    del num_layers
    return num_stages

  # -- state ----------------------------------------------------------------------------------

  def init_state(self, params) -> dict:
    """Extra train-state entries the mode carries, e.g. last step's gradients."""
    del params
    return {}

  # -- the update -----------------------------------------------------------------------------

  def wrap_update(self, update):
    """The (state, grads, stats, sumsq) -> (state, metrics) update every cell applies."""
    return update

  def update(self, update, pod: int, state, grads, stats: list, sumsq, **extras):
    """One cell's optimizer step: `stats` are every pod's loss statistics (in pod order),
    `sumsq` the squared gradient norm of the whole model, `extras` the mode's apply inputs.
    The pods' statistics are merged in pod order by the run's objective (objectives.py)."""
    del pod, extras
    new_state, metrics = update(state, grads, self.objective.merge_all(stats), sumsq)
    if self.num_pods > 1:
      for q, st in enumerate(stats):
        metrics[f"pod{q}_loss"] = st["loss_sum"] / jnp.maximum(st["tokens"], 1.0)
    return new_state, metrics

  # -- the step program -----------------------------------------------------------------------

  def compile_cell(self, cell) -> None:
    """Compiles the mode's pieces for one cell (`cell`: a pipeline.pieces.CellPieces)."""

  def gradient_nodes(self, builder, grads: dict) -> dict:
    """Adds the nodes that combine the pods' gradients once each cell's backward is done;
    `grads` maps cell -> ref of its summed gradients; returns the refs the update uses."""
    del builder
    return grads

  def apply_inputs(self, cell) -> dict:
    """{name: abstract value, or a list of them} the mode adds to a cell's apply piece."""
    del cell
    return {}

  def apply_refs(self, builder, cell: tuple) -> dict:
    """The refs for `apply_inputs`, emitted (with any transfers) just before the cell's apply."""
    del builder, cell
    return {}

  def program_kind(self, step: int) -> str:
    """Which program step `step` (0-based) runs: "step", or a mode's own (DiLoCo's "outer")."""
    del step
    return "step"

  def outer_nodes(self, builder, final: dict, norm_sums: dict) -> tuple[dict, dict]:
    """For a program kind other than "step": nodes after the apply. `final` and `norm_sums` map
    each cell to the ref of its new state and of its share of the step's parameter and update
    norms (step.norm_sums); returns both as the nodes change them."""
    del builder
    return final, norm_sums

  # -- cost (the dry run) ---------------------------------------------------------------------

  def bytes_per_step(self, stage_grads: list) -> int:
    """Bytes one pod sends to the other pods per (outer) step; `stage_grads` are the abstract
    gradients of each of a pod's cells."""
    del stage_grads
    return 0

  def received_copies(self) -> int:
    """How many encoded copies of a cell's gradients a cell holds while it reduces."""
    return 0

  def exposed_s(self, transfer_s: float, compute_s: float | None, num_layers: int):
    """The part of the cross-pod transfer the step waits for (None: cannot tell)."""
    del transfer_s, compute_s, num_layers
    return 0.0
