"""What a block keeps for its backward and what its backward recomputes, per `model.remat`.

The dry run's per-policy arithmetic (models/remat.py names the policies; models/layers.py is the
block). It belongs next to arithmetic.layer_activation_bytes in models/arithmetic.py, and should
move there; it lives here because the dry run is its only user so far.

Per token, for one parallel block split `tensor` = t ways, in the notation of
models/arithmetic.py (d, H, g, K, F, T) with B = the activation dtype's bytes. A remat policy
wraps each block in `jax.checkpoint`, so the block's input (B d) is always kept, and the rest is
what the policy saves of what the backward needs:
  none     everything autodiff saves: arithmetic.layer_activation_bytes (an estimate of what
           survives XLA's fusion; the jaxpr itself saves more float32 temporaries)
  full     the block input only: B d
  dots     the block input and the outputs of the matmuls with no batch dimension that the
           backward needs: the q, k and v projections (before RoPE) and the MLP's gate and up
           projections, B (d + HK/t + 2gK + 2F/t). The output projections (wo, w_down) are not
           kept: a parallel block adds them straight into the residual, so the backward never
           reads them. The attention scores and weighted sum (batch dims b and g) are not kept.
  outputs  the block input and the values named "attention" (the heads' weighted values, before
           wo) and "mlp" (the SwiGLU hidden, before w_down): B (d + HK/t + F/t)
These are the residuals `jax.vjp` keeps for the model's loss (tests/test_dryrun.py checks them
against it on a small model).

Matmul FLOPs per token the backward recomputes for one block (FLOPs of other work are not
counted, as nowhere in the model's arithmetic). A recomputation runs only what the backward
needs, so wo and w_down, whose outputs it never reads, are not recomputed by any policy:
  none     0
  full     the projections q, k, v, gate and up, and attention's scores and weighted sum:
           2 (dHK + 2dgK + 2dF) + 4HKT (the block's forward, 1/3 of its training FLOPs, less wo
           and w_down)
  dots     attention's scores and weighted sum (matmuls with batch dims, not saved): 4HKT
  outputs  the projections q, k, v, gate and up (to recompute what "attention" and "mlp" were
           computed from) and the scores (the softmax's backward needs them): 2 (dHK + 2dgK
           + 2dF) + 2HKT
The jaxpr of the loss's gradient executes exactly these extra dot_general FLOPs (tested). An MoE
layer is costed as a dense block whose gate and up are the active experts' (top_k of them).
"""

import jax.numpy as jnp

from pwtrain.models import arithmetic
from pwtrain.models import moe as moe_lib
from pwtrain.models.remat import REMAT


def remat_of(m) -> str:
  """The config's `model.remat` ("none" when absent), checked against models/remat.REMAT."""
  name = m.get("remat", "none")
  if name not in REMAT:
    raise ValueError(f"model.remat={name!r} is not a remat policy; valid: {', '.join(REMAT)}")
  return name


def kept_bytes_per_token(m, tensor: int, seq_len: int, remat: str) -> float:
  """Bytes per token one block keeps for its backward under `remat`, split `tensor` ways."""
  b = jnp.dtype(m.dtype).itemsize
  heads = m.num_heads / tensor
  if remat == "none":
    return arithmetic.layer_activation_bytes(m, tensor, seq_len)
  if remat == "full":
    return b * m.d_model
  if remat == "dots":
    return b * (
      m.d_model + heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim + 2 * m.d_ff / tensor
    )
  if remat == "outputs":
    return b * (m.d_model + heads * m.head_dim + m.d_ff / tensor)
  raise ValueError(f"model.remat={remat!r} is not a remat policy; valid: {', '.join(REMAT)}")


def recompute_flops_per_token(m, moe, seq_len: int, remat: str, layer: int) -> float:
  """Matmul FLOPs per token the backward of block `layer` recomputes under `remat`."""
  if remat == "none":
    return 0.0
  qkv = m.d_model * m.head_dim * (m.num_heads + 2 * m.num_kv_heads)
  if moe_lib.is_moe_layer(moe, layer):
    gate_up = 2 * m.d_model * moe.top_k * moe_lib.expert_d_ff(m, moe)
  else:
    gate_up = 2 * m.d_model * m.d_ff
  scores = 2.0 * m.num_heads * m.head_dim * seq_len  # one of attention's two matmuls
  if remat == "full":
    return 2.0 * (qkv + gate_up) + 2 * scores
  if remat == "dots":
    return 2 * scores
  if remat == "outputs":
    return 2.0 * (qkv + gate_up) + scores
  raise ValueError(f"model.remat={remat!r} is not a remat policy; valid: {', '.join(REMAT)}")
