"""Rematerialisation of the decoder's blocks: what each block keeps for its backward.

`model.remat` names the policy, applied to every block (`jax.checkpoint` around the block):
  none     no remat: autodiff keeps every intermediate it needs
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

REMAT = ("none", "full", "dots", "outputs")


def policy(name: str):
  """The `jax.checkpoint` policy of `model.remat=name` (None: save nothing, i.e. "full")."""
  if name == "full":
    return None
  if name == "dots":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  if name == "outputs":
    return jax.checkpoint_policies.save_only_these_names("attention", "mlp")
  raise ValueError(f"model.remat={name!r} is not a remat policy; valid: {', '.join(REMAT)}")
