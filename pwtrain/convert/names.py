"""The one table of names and layouts that both directions of conversion read.

Each `Entry` pairs a parameter of pwtrain's whole-model params (its path in the unrolled
checkpoint layout, e.g. "blocks/3/attn/wq") with a Hugging Face tensor ("model.layers.3.
self_attn.q_proj.weight") and the `Layout` between the two:

  same       identical shape and order (embeddings, norms)
  T          a transposed matrix: pwtrain's kernels are [in, out], torch Linear's [out, in]
  in_heads   pwtrain [d_model, heads, head_dim] <-> HF [heads * head_dim, d_model] (q, k, v)
  out_heads  pwtrain [heads, head_dim, d_model] <-> HF [d_model, heads * head_dim] (o)
  heads      pwtrain [heads, head_dim] <-> HF [heads * head_dim] (q, k, v biases)

Rope needs no permutation: both rotate the pairs (x[i], x[i + head_dim/2]) of each head
(models/family.py). Every layout only moves elements, so a round trip is bitwise.

`Layout.read(shape, index, read_hf)` gives the block of the pwtrain-shaped array at `index` (a
tuple of slices: one device's shard) from a reader of slices of the HF tensor, reading only the
rows and columns that block needs (with a head split, whole heads' rows), so an import reads
each device's shard straight from the file.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  name: str

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """The whole pwtrain array -> the HF tensor."""
    if self.name == "same":
      return x
    if self.name == "T":
      return np.ascontiguousarray(x.T)
    if self.name == "in_heads":
      return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    if self.name == "out_heads":
      return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
    return x.reshape(-1)  # heads

  def hf_shape(self, shape: tuple) -> tuple:
    """The HF tensor's shape for a pwtrain array of `shape`."""
    if self.name == "same":
      return tuple(shape)
    if self.name == "T":
      return tuple(reversed(shape))
    if self.name == "in_heads":
      return (shape[1] * shape[2], shape[0])
    if self.name == "out_heads":
      return (shape[2], shape[0] * shape[1])
    return (shape[0] * shape[1],)

  def read(self, shape: tuple, index: tuple, read_hf) -> np.ndarray:
    """The block `index` of the pwtrain array of `shape`, from `read_hf(slices)` (a block of
    the HF tensor)."""
    a = [range(*s.indices(n)) for s, n in zip(_full(index, shape), shape, strict=True)]
    if self.name == "same":
      return read_hf(tuple(slice(r.start, r.stop) for r in a))
    if self.name == "T":
      return read_hf(tuple(slice(r.start, r.stop) for r in reversed(a))).T
    if self.name == "heads":
      head, k = shape[1], a[1]
      rows = read_hf((slice(a[0].start * head, a[0].stop * head),))
      return rows.reshape(len(a[0]), head)[:, k.start : k.stop]
    if self.name == "in_heads":
      d, h, k = a
      head = shape[2]
      block = read_hf((slice(h.start * head, h.stop * head), slice(d.start, d.stop)))
      return block.reshape(len(h), head, len(d))[:, k.start : k.stop].transpose(2, 0, 1)
    h, k, d = a  # out_heads
    head = shape[1]
    block = read_hf((slice(d.start, d.stop), slice(h.start * head, h.stop * head)))
    return block.reshape(len(d), len(h), head)[:, :, k.start : k.stop].transpose(1, 2, 0)


def _full(index: tuple, shape: tuple) -> tuple:
  return tuple(index) + (slice(None),) * (len(shape) - len(index))


SAME, T, IN_HEADS, OUT_HEADS, HEADS = (
  Layout(n) for n in ("same", "T", "in_heads", "out_heads", "heads")
)


@dataclasses.dataclass(frozen=True)
class Entry:
  path: str  # in pwtrain's unrolled params, "/"-joined
  hf: str  # the Hugging Face tensor's name
  layout: Layout


def table(model_cfg) -> list[Entry]:
  """Every parameter of model config `model_cfg` (a llama or gemma family) with its Hugging Face
  tensor (every supported architecture, hf_config.ARCHITECTURES, names them alike), in
  Hugging Face's order."""
  from pwtrain.models import family as family_lib

  family = family_lib.of(model_cfg)
  entries = [Entry("embedding", "model.embed_tokens.weight", SAME)]
  # Llama's second norm is "post_attention_layernorm" (after attention, before the MLP); Gemma
  # 2, with norms after attention too, calls that one so and the MLP's "pre_feedforward".
  mlp_norm = "pre_feedforward_layernorm" if family.post_norms else "post_attention_layernorm"
  for i in range(model_cfg.num_layers):
    pw, hf = f"blocks/{i}", f"model.layers.{i}"
    entries.append(Entry(f"{pw}/attn_norm/scale", f"{hf}.input_layernorm.weight", SAME))
    for p, h in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
      entries.append(Entry(f"{pw}/attn/{p}", f"{hf}.self_attn.{h}.weight", IN_HEADS))
    entries.append(Entry(f"{pw}/attn/wo", f"{hf}.self_attn.o_proj.weight", OUT_HEADS))
    if family.qkv_bias:
      for p, h in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
        entries.append(Entry(f"{pw}/attn/{p}", f"{hf}.self_attn.{h}.bias", HEADS))
    if family.qk_norm:
      for p, h in (("q_norm", "q_norm"), ("k_norm", "k_norm")):
        entries.append(Entry(f"{pw}/attn/{p}/scale", f"{hf}.self_attn.{h}.weight", SAME))
    entries.append(Entry(f"{pw}/mlp_norm/scale", f"{hf}.{mlp_norm}.weight", SAME))
    if family.post_norms:
      for p, h in (("post_attn_norm", "post_attention"), ("post_mlp_norm", "post_feedforward")):
        entries.append(Entry(f"{pw}/{p}/scale", f"{hf}.{h}_layernorm.weight", SAME))
    for p, h in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
      entries.append(Entry(f"{pw}/mlp/{p}", f"{hf}.mlp.{h}.weight", T))
  entries.append(Entry("final_norm/scale", "model.norm.weight", SAME))
  if not family.tied:
    entries.append(Entry("unembedding", "lm_head.weight", T))
  return entries
