"""Rematerialisation of the decoder's blocks: what each block keeps for its backward.

`model.remat` names the policy, applied to every block (`jax.checkpoint` around the block):
  none     no remat: autodiff keeps every intermediate it needs. A scanned model
           (`model.scan_layers`) keeps every matmul's output instead and recomputes the
           elementwise ops between them in the backward (`scanned_policy`)
  full     keep only the block's input; the backward recomputes the whole block
  dots     keep the outputs of matmuls with no batch dimension (the projections;
           `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`), recompute the rest
  outputs  keep only the outputs of attention (the heads' weighted values, before the output
           projection) and of the MLP (the SwiGLU hidden activation, before the down
           projection), tagged "attention" and "mlp" in layers.py; recompute everything else.
           (A parallel block's output projections add straight into the residual, so their
           results are never needed in the backward: these are the attention and MLP results
           worth keeping.)
From most to least memory: none, dots, outputs, full; gradients are the same for all.
"""

import jax

from pwtrain.errors import ConfigError

REMAT = ("none", "full", "dots", "outputs")


def policy(name: str):
  """The `jax.checkpoint` policy of `model.remat=name` (None: save nothing, i.e. "full")."""
  if name == "full":
    return None
  if name == "dots":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  if name == "outputs":
    return jax.checkpoint_policies.save_only_these_names("attention", "mlp")
  raise ConfigError(f"model.remat={name!r} is not a remat policy; valid: {', '.join(REMAT)}")


def keep_matmuls(prim, *args, **params) -> bool:
  """A `jax.checkpoint` policy: keep the outputs of matmuls (dot_general, with or without batch
  dims, and ragged_dot_general: dropless MoE experts) and of convolutions; recompute the rest."""
  return jax.checkpoint_policies.dots_saveable(prim, *args, **params) or (
    prim.name == "ragged_dot_general"
  )


def scanned_policy(name: str):
  """The `jax.checkpoint` policy of a scanned model's blocks (models/scan.py) at
  `model.remat=name`: `policy(name)`, and `keep_matmuls` for "none".

  Why not keep everything at "none", as the unrolled model does: in a scan every value a block
  keeps for its backward is a residual stacked over the periods: JAX zero-fills a [periods, ...]
  buffer for it, each forward iteration writes its slice and each backward iteration slices it
  back out, passes over memory that the unrolled model (whose kept values XLA leaves in place,
  often fused into their consumers) does not make. The elementwise results (SwiGLU's silu, the
  softmax, the norm, RoPE) cost less to recompute inside the backward's fusions than to carry
  so; the matmuls, which cost more, are kept. Gradients are the same, and the block keeps less
  memory than unrolled at "none". Measured with experiments/bench_scan.py at remat=none,
  scanned/unrolled training throughput: 0.80 (1 CPU device) and 0.93 (8) keeping everything,
  0.88 and 1.10 keeping the matmuls; 0.96 and 1.06 once SwiGLU also multiplied token rows
  (layers.py).
  """
  return keep_matmuls if name == "none" else policy(name)
