"""The decoder's arithmetic: parameter counts, FLOPs and activation bytes, per layer and whole, for
every family (models/family.py: its norms, biases, output layer and sliding windows).

One place for what the plan (stage balancing), the metrics (MFU) and the dry run (memory, step
time) compute from the model's shapes, so they cannot disagree. Everything takes the model and
MoE configs (`model.*`, `moe.*`) and plain numbers; nothing here builds or traces a model.

Notation: d = d_model, H = num_heads, g = num_kv_heads, K = head_dim, F = d_ff, V = vocab_size,
T = seq_len, L = num_layers. Training FLOPs are PaLM's (Chowdhery et al., 2022, appendix B):
6 per parameter and token (forward 2, backward 4) plus 12 L H K T for attention's scores and
weighted sum, with the embedding lookup (a gather) counted as no FLOPs; a local layer's queries
see at most its window of keys (12 H K min(T, window)). A tied output layer is the embedding's
matrix, counted once (its matmul in `layer_costs`, not in 6N, as PaLM counts it); an untied one
(Llama) is a matrix of its own, counted in both.
"""

import math

import jax.numpy as jnp

from pwtrain.errors import ConfigError
from pwtrain.models import family as family_lib
from pwtrain.models import moe as moe_lib
from pwtrain.models.remat import REMAT


def attention_params(m) -> int:
  """One block's attention projections: q and output (H heads), k and v (g heads); with the
  family's q/k/v biases and per-head q/k norms."""
  family = family_lib.of(m)
  extra = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if family.qkv_bias else 0
  extra += 2 * m.head_dim if family.qk_norm else 0
  return m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) + extra


def block_norms(m) -> int:
  """Norms per block: one shared (PaLM's parallel block), two (before attention and the MLP),
  four with post-norms (Gemma 2)."""
  family = family_lib.of(m)
  return 1 if family.parallel_block else 4 if family.post_norms else 2


def output_params(m) -> int:
  """Parameters of an untied output layer (0 when it is the embedding)."""
  return 0 if family_lib.of(m).tied else m.vocab_size * m.d_model


def attention_span(m, layer: int, seq_len: int) -> int:
  """Keys a query of layer `layer` sees at most: seq_len, or a local layer's window."""
  window = family_lib.of(m).window(layer)
  return min(seq_len, window) if window else seq_len


def ffn_params(m, moe, layer: int) -> tuple[int, int]:
  """(all, active per token) parameters of layer `layer`'s FFN: the dense SwiGLU, or an MoE
  layer's experts and router (a token uses top_k experts)."""
  if not moe_lib.is_moe_layer(moe, layer):
    return 3 * m.d_model * m.d_ff, 3 * m.d_model * m.d_ff
  expert = 3 * m.d_model * moe_lib.expert_d_ff(m, moe)
  router = m.d_model * moe.num_experts
  return moe.num_experts * expert + router, moe.top_k * expert + router


def param_count(m, moe, *, active: bool = False) -> int:
  """Parameters of the model (the embedding, an untied output layer); with `active`, an MoE
  layer counts only the top_k experts a token uses (and its router)."""
  mlp = sum(ffn_params(m, moe, layer)[1 if active else 0] for layer in range(m.num_layers))
  norms = (m.num_layers * block_norms(m) + 1) * m.d_model  # the blocks' scales, the final one
  embedding = m.vocab_size * m.d_model + output_params(m)
  return embedding + m.num_layers * attention_params(m) + mlp + norms


def flops_per_token(m, moe, seq_len: int) -> float:
  """Training FLOPs per token, 6N + 12LHKT (N: active parameters, embedding excluded; T a local
  layer's window where that is shorter)."""
  n = param_count(m, moe, active=True) - m.vocab_size * m.d_model
  spans = sum(attention_span(m, layer, seq_len) for layer in range(m.num_layers))
  return 6.0 * n + 12.0 * m.num_heads * m.head_dim * spans


def layer_costs(m, moe, seq_len: int) -> tuple[list[float], float, float]:
  """Training FLOPs per token of each block, of the embedding lookup and of the output layer."""
  blocks = [
    6.0 * (attention_params(m) + ffn_params(m, moe, layer)[1])
    + 12.0 * m.num_heads * m.head_dim * attention_span(m, layer, seq_len)
    for layer in range(m.num_layers)
  ]
  head = 6.0 * m.vocab_size * m.d_model
  embed = 0.0  # a gather: no matmul FLOPs
  return blocks, embed, head


def layer_activation_bytes(m, tensor: int, seq_len: int) -> float:
  """Bytes autodiff saves per token for one block split `tensor` ways: B(2nd + 2HK/t + 2gK +
  3F/t) (each of the block's n norms' input and output, block_norms: PaLM's one LayerNorm; q
  and the attention output; k and v; gate, up, hidden) + (4 + B) H/t T (softmax probabilities
  in float32 and their cast), B = the activation dtype's bytes."""
  b = jnp.dtype(m.dtype).itemsize
  heads = m.num_heads / tensor
  saved = 2 * block_norms(m) * m.d_model + 2 * (heads + m.num_kv_heads) * m.head_dim
  saved += 3 * m.d_ff / tensor
  return b * saved + (4 + b) * heads * seq_len


def head_activation_bytes(m, tensor: int) -> float:
  """Bytes per token the output layer keeps: float32 logits and their gradient over its V/t
  vocabulary shard, and its input."""
  return 8 * math.ceil(m.vocab_size / tensor) + jnp.dtype(m.dtype).itemsize * m.d_model


def gathered_bytes(m, moe, layers, embedding: bool, tensor: int, expert: int) -> float:
  """Bytes one device holds of FSDP-gathered weights at once, when the island's `layers` (an
  iterable of layer indices) and, with `embedding`, the shared embedding matrix are sharded
  over an fsdp axis: the largest block's weights gathered for its pass, and its unreduced
  gradient before the reduce-scatter, and the embedding matrix (gathered whole for the output
  layer) likewise, each split `tensor` ways (an MoE layer's experts also `expert` ways), in the
  activation dtype: 2 B max(block) / t + (2 B V d / t with the embedding)."""
  b = jnp.dtype(m.dtype).itemsize

  def block(layer):
    ffn = ffn_params(m, moe, layer)[0]
    return attention_params(m) + (ffn / expert if moe_lib.is_moe_layer(moe, layer) else ffn)

  largest = max((block(layer) for layer in layers), default=0)
  vocab = m.vocab_size * m.d_model if embedding else 0
  return 2 * b * (largest + vocab) / tensor


def layer_input_bytes(m) -> float:
  """Bytes per token a rematerialised block keeps: its input."""
  return jnp.dtype(m.dtype).itemsize * m.d_model


# -- rematerialisation (models/remat.py): what a block keeps, and what its backward recomputes --
#
# Per token, for one parallel block split `tensor` = t ways, in the notation of
# models/arithmetic.py (d, H, g, K, F, T) with B = the activation dtype's bytes. A remat policy
# wraps each block in `jax.checkpoint`, so the block's input (B d) is always kept, and the rest is
# what the policy saves of what the backward needs:
#   none     everything autodiff saves: arithmetic.layer_activation_bytes (an estimate of what
#            survives XLA's fusion; the jaxpr itself saves more float32 temporaries, and a
#            pipeline stage at parallel.stage_remat="none" returns all of them from its forward:
#            1.8x this on the test model, and with bf16 compute on float32 weights the weights'
#            bf16 casts too). A scanned
#            model (model.scan_layers) keeps only the block input and every matmul output the
#            backward needs (remat.scanned_policy): dots' set, and attention's scores and weighted
#            sum, B (d + 2HK/t + 2gK + 2F/t + HT/t)
#   full     the block input only: B d
#   dots     the block input and the outputs of the matmuls with no batch dimension that the
#            backward needs: the q, k and v projections (before RoPE) and the MLP's gate and up
#            projections, B (d + HK/t + 2gK + 2F/t). The output projections (wo, w_down) are not
#            kept: a parallel block adds them straight into the residual, so the backward never
#            reads them. The attention scores and weighted sum (batch dims b and g) are not kept.
#   outputs  the block input and the values named "attention" (the heads' weighted values, before
#            wo) and "mlp" (the SwiGLU hidden, before w_down): B (d + HK/t + F/t)
# These are the residuals `jax.vjp` keeps for the model's loss (tests/test_dryrun.py checks them
# against it on a small model).
#
# Matmul FLOPs per token the backward recomputes for one block (FLOPs of other work are not
# counted, as nowhere in the model's arithmetic). A recomputation runs only what the backward
# needs, so wo and w_down, whose outputs it never reads, are not recomputed by any policy:
#   none     0
#   full     the projections q, k, v, gate and up, and attention's scores and weighted sum:
#            2 (dHK + 2dgK + 2dF) + 4HKT (the block's forward, 1/3 of its training FLOPs, less wo
#            and w_down)
#   dots     attention's scores and weighted sum (matmuls with batch dims, not saved): 4HKT
#   outputs  the projections q, k, v, gate and up (to recompute what "attention" and "mlp" were
#            computed from) and the scores (the softmax's backward needs them): 2 (dHK + 2dgK
#            + 2dF) + 2HKT
# The jaxpr of the loss's gradient executes exactly these extra dot_general FLOPs (tested). An MoE
# layer is costed as a dense block whose gate and up are the active experts' (top_k of them).


def remat_kept_bytes(m, tensor: int, seq_len: int, remat: str) -> float:
  """Bytes per token one block keeps for its backward under `remat`, split `tensor` ways (at
  "none", what the unrolled or the scanned model keeps, as `m.scan_layers` says)."""
  b = jnp.dtype(m.dtype).itemsize
  heads = m.num_heads / tensor
  if remat == "none" and m.scan_layers:
    dots = remat_kept_bytes(m, tensor, seq_len, "dots")
    return dots + b * heads * (m.head_dim + seq_len)
  if remat == "none":
    return layer_activation_bytes(m, tensor, seq_len)
  if remat == "full":
    return b * m.d_model
  if remat == "dots":
    return b * (
      m.d_model + heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim + 2 * m.d_ff / tensor
    )
  if remat == "outputs":
    return b * (m.d_model + heads * m.head_dim + m.d_ff / tensor)
  raise ConfigError(f"model.remat={remat!r} is not a remat policy; valid: {', '.join(REMAT)}")


def remat_recompute_flops(m, moe, seq_len: int, remat: str, layer: int) -> float:
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
  raise ConfigError(f"model.remat={remat!r} is not a remat policy; valid: {', '.join(REMAT)}")
