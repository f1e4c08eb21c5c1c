"""`sync` (PaLM): every pod sums every pod's gradients, so all pods apply the same update.

Each pod sends each cell's gradients as soon as that cell's backward is done, and every pod sums
the (decoded) gradients of all pods, its own too, in pod order, so the pods' parameters stay
bitwise identical. With `exchange.compression` the gradients travel encoded; with
`exchange.error_feedback` what the encoding lost is kept per pod (the `residual` state entry)
and added to the next step's gradients before encoding (the residuals differ per pod, so
checkpoints then hold every pod's state). The reporting pod's last cell (pod 0's; with elastic
pods hosting pod 0, the lowest live pod's) also reports each pod's gradient norm.
"""

import jax
import jax.numpy as jnp

from pwtrain import step as step_lib
from pwtrain.parallel.exchange import compression as codec
from pwtrain.parallel.exchange.base import Exchange


class Sync(Exchange):
  mode = "sync"

  def __init__(self, config):
    super().__init__(config)
    self.feedback = self.compression != "none" and self.cfg.error_feedback
    self.per_pod_state = self.feedback
    # Elastic pods: any pod's last cell can report (the lowest live pod does), so that a pod
    # set hosting pod 0 runs with the pieces it has (PipelineProgram.hosted).
    self.any_pod_reports = config.fault.elastic

  def init_state(self, params) -> dict:
    if self.feedback:
      return {"residual": jax.tree.map(jnp.zeros_like, params)}
    return {}

  def update(self, update, pod, state, grads, stats, sumsq, *, residual=None, pod_norms=()):
    if residual is not None:  # the residual the encoding left, kept for the next step
      state = {**state, "residual": residual}
    new_state, metrics = super().update(update, pod, state, grads, stats, sumsq)
    if pod_norms:
      per_pod = jnp.sqrt(sum(pod_norms))
      for q, st in enumerate(stats):
        metrics[f"pod{q}_grad_norm"] = per_pod[q] / jnp.maximum(st["tokens"], 1.0)
    return new_state, metrics

  # -- pieces ---------------------------------------------------------------------------------

  def compile_cell(self, cell) -> None:
    compression, grads_abs = self.compression, cell.grads_abs
    parts_abs = grads_abs
    if self.feedback:
      enc = cell.compile(
        "enc",
        lambda grads, state: codec.encode_with_feedback(grads, state["residual"], compression),
        {"grads": grads_abs, "state": cell.state_abs},
      )
      parts_abs = enc.out_abstract[0]
    elif compression != "none":
      enc = cell.compile(
        "enc", lambda grads: codec.encode(grads, compression), {"grads": grads_abs}
      )
      parts_abs = enc.out_abstract
    stage = cell.stage

    def reduce_fn(parts):
      parts = [codec.decode(part, compression) for part in parts]
      # Each pod's squared gradient norm, for per-pod metrics. Under pipelining a pod's
      # embedding gradient is split in two halves; it is counted by its first-stage half.
      sumsqs = [step_lib.sum_of_squares(stage.counted(g)) for g in parts]
      return codec.tree_sum(parts), jnp.stack(sumsqs)

    cell.compile(
      "reduce",
      reduce_fn,
      {"parts": [parts_abs] * self.num_pods},
      out_shardings=(cell.grads_sharding, cell.replicated),
    )

  def apply_inputs(self, cell) -> dict:
    inputs = {}
    if self.feedback:
      inputs["residual"] = cell.grads_abs
    if self.reports(cell.key, cell.num_stages):
      norm = jax.ShapeDtypeStruct((self.num_pods,), jnp.float32, sharding=cell.replicated)
      inputs["pod_norms"] = [norm] * cell.num_stages
    return inputs

  def reports(self, key: tuple, num_stages: int) -> bool:
    """Whether cell `key`'s apply takes every pod's gradient norm, for the metrics: pod 0's last
    cell, or with elastic pods every pod's (any may report)."""
    return key[1] == num_stages - 1 and (key[0] == 0 or self.any_pod_reports)

  # -- nodes ----------------------------------------------------------------------------------

  def gradient_nodes(self, builder, grads: dict) -> dict:
    grads = dict(grads)
    for key in builder.cells:
      if self.feedback:
        name = builder.node(key, "enc", grads=grads[key], state=builder.state_key(key))
        grads[key] = (name, 0)
      elif self.compression != "none":
        grads[key] = (builder.node(key, "enc", grads=grads[key]), 0)
    sent, pods = dict(grads), builder.pods
    for p, s in builder.owners:  # a hosted pod's gradients are summed by the others only
      reduce = builder.piece((p, s), "reduce")
      parts = [
        sent[(p, s)]
        if q == p
        else builder.move(
          (p, s), f"{q}>{p}:g{s}", sent[(q, s)], sharding=reduce.input_sharding("parts", i)
        )
        for i, q in enumerate(pods)
      ]
      grads[(p, s)] = (builder.node((p, s), "reduce", parts=parts), 0)
    return grads

  def apply_refs(self, builder, cell: tuple) -> dict:
    p, s = cell
    refs = {}
    if self.feedback:
      refs["residual"] = (f"{p}:enc{s}", 1)
    if self.reports(cell, builder.num_stages):
      refs["pod_norms"] = [
        (f"{p}:reduce{t}", 1)
        if t == s
        else builder.move(cell, f"{p}:pn{t}", (f"{p}:reduce{t}", 1), ())
        for t in range(builder.num_stages)
      ]
    return refs

  # -- cost -----------------------------------------------------------------------------------

  def bytes_per_step(self, stage_grads: list) -> int:
    sent = sum(codec.encoded_bytes(g, self.compression) for g in stage_grads)
    return (self.num_pods - 1) * sent

  def received_copies(self) -> int:
    # Other pods' encoded gradients, and this pod's own when it is encoded.
    return self.num_pods if self.compression != "none" else self.num_pods - 1

  def exposed_s(self, transfer_s, compute_s, num_layers):
    del compute_s, num_layers
    return transfer_s  # sent when the backward is done, summed before the update
