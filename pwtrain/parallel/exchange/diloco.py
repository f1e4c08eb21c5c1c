"""`diloco` (Douillard et al., 2023): local inner steps, then an outer step on averaged deltas.

Pods take `exchange.inner_steps` optimizer steps on their own gradients alone (the metrics still
cover every pod); then each sends its parameter delta since the last outer step (a
pseudo-gradient, compressed like gradients), all average the deltas in pod order and step the
shared anchor with SGD + Nesterov momentum (`exchange.outer_lr`, `exchange.outer_momentum`), and
set their parameters to it. Pods are identical after each outer step; their inner optimizer
states stay their own, so checkpoints hold every pod's state.

An outer step's parameter update is the inner step's and the outer step's together: each cell
keeps a copy of its parameters from before the step (`keep`, one parameter-sized buffer during
the step's apply and outer nodes) so that the outer node reports the norm of all of it.
"""

import jax
import optax

from pwtrain import step as step_lib
from pwtrain.errors import ConfigError
from pwtrain.parallel.exchange import compression as codec
from pwtrain.parallel.exchange.base import Exchange


class DiLoCo(Exchange):
  mode = "diloco"
  per_pod_state = True
  program_kinds = ("step", "outer")

  def __init__(self, config):
    super().__init__(config)
    cfg = self.cfg
    self.outer_tx = optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)

  @classmethod
  def validate(cls, cfg) -> None:
    if cfg.error_feedback:
      raise ConfigError(
        "exchange.error_feedback=True needs a gradient exchange; exchange.mode='diloco' sends "
        "parameter deltas (set exchange.error_feedback=False)"
      )

  def init_state(self, params) -> dict:
    """The anchor (parameters after the last outer step) and its optimizer's state."""
    return {"outer": {"anchor": params, "opt_state": self.outer_tx.init(params)}}

  def update(self, update, pod, state, grads, stats, sumsq, **extras):
    # Each pod steps on its own gradients; the metrics describe every pod's.
    new_state, _ = update(state, grads, stats[pod], sumsq)
    _, metrics = super().update(update, pod, state, grads, stats, sumsq, **extras)
    return new_state, metrics

  def program_kind(self, step: int) -> str:
    return "outer" if (step + 1) % self.cfg.inner_steps == 0 else "step"

  # -- pieces and nodes -----------------------------------------------------------------------

  def compile_cell(self, cell) -> None:
    compression = self.compression

    def delta_fn(state):
      anchor = state["outer"]["anchor"]
      return codec.encode(jax.tree.map(jax.numpy.subtract, anchor, state["params"]), compression)

    delta = cell.compile("delta", delta_fn, {"state": cell.state_abs})

    stage = cell.stage
    cell.compile(
      "keep",
      lambda state: state["params"],
      {"state": cell.state_abs},
      out_shardings=cell.grads_sharding,
    )

    def outer_fn(state, deltas, before):
      deltas = [codec.decode(d, compression) for d in deltas]
      mean = jax.tree.map(lambda x: x / len(deltas), codec.tree_sum(deltas))
      outer = state["outer"]
      updates, opt_state = self.outer_tx.update(mean, outer["opt_state"], outer["anchor"])
      anchor = optax.apply_updates(outer["anchor"], updates)
      new_state = {**state, "params": anchor, "outer": {"anchor": anchor, "opt_state": opt_state}}
      return new_state, step_lib.norm_sums(stage.counted(before), stage.counted(anchor))

    cell.compile(
      "outer",
      outer_fn,
      {
        "state": cell.state_abs,
        "deltas": [delta.out_abstract] * self.num_pods,
        "before": cell.grads_abs,
      },
      out_shardings=(cell.shardings, cell.replicated),
      donate=("state",),
    )

  def apply_refs(self, builder, cell: tuple) -> dict:
    """Before an outer step's apply: the cell's parameters from before the step (`keep`)."""
    if builder.kind == "outer":
      builder.node(cell, "keep", state=builder.state_key(cell))
    return {}

  def outer_nodes(self, builder, final: dict, norm_sums: dict) -> tuple[dict, dict]:
    """Every pod sends its delta; each averages them and steps the anchor."""
    for key in builder.cells:
      builder.node(key, "delta", state=final[key])
    final, norm_sums = dict(final), dict(norm_sums)
    for p, s in builder.cells:
      outer = builder.piece((p, s), "outer")
      deltas = [
        (f"{p}:delta{s}", 0)
        if q == p
        else builder.move(
          (p, s), f"{q}>{p}:d{s}", (f"{q}:delta{s}", 0), sharding=outer.input_sharding("deltas", i)
        )
        for i, q in enumerate(builder.pods)
      ]
      before = (f"{p}:keep{s}", 0)
      name = builder.node((p, s), "outer", state=final[(p, s)], deltas=deltas, before=before)
      final[(p, s)], norm_sums[(p, s)] = (name, 0), (name, 1)
    return final, norm_sums

  # -- cost -----------------------------------------------------------------------------------

  def bytes_per_step(self, stage_grads: list) -> int:
    sent = sum(codec.encoded_bytes(g, self.compression) for g in stage_grads)
    return (self.num_pods - 1) * sent  # per outer step

  def exposed_s(self, transfer_s, compute_s, num_layers):
    del compute_s, num_layers
    return transfer_s / self.cfg.inner_steps  # one exchange every inner_steps steps
