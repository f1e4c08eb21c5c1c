"""The serving engine's compiled pieces for one layout of the weights (weights.Layout), and the
programs it runs through the controller. Their shapes never change, so nothing recompiles
whatever the requests are.

Slots. Each cell holds a KV cache of `max_batch` slots x `max_len` positions for its layers
(models/decode.py), on its island (the slots split over the island's batch axes where they
divide, else held whole). A sequence holds one slot from its prefill to its last token.

  init      zeros into every cell's cache.
  prefill   one chunk of `chunk` tokens of one sequence into its slot (cache rows [slot]),
            right-padded; the last chunk's logits give the sequence's first token.
  decode    one token of every slot at its own position: the engine feeds each decoding slot its
            last token, and every other slot (free, or between prefill chunks) a pad at position
            max_len - 1, a scratch position that no sequence uses (a sequence of n prompt
            tokens and m new ones fills positions 0 .. n + m - 2 <= max_len - 2: the requests
            module keeps n + m <= max_len).
  probe     each cell's published step (whether the weights are there yet).

A program runs the cells in layer order, each on its own island reading its weights where they
are published (program.Latest) and its own cache: one node for one cell; for a pipeline, one
node per stage with the activations moved between islands by the controller's transfers. The
last cell picks the next token of every row by the rule of models/sampling.py with the row's
own settings (sampling.pick), and its log-probability and the `TOP` most likely ids' (the
model's distribution, before temperature, top-k and top-p). Every cell returns the step of the
weights it read.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain import sharding as sharding_lib
from pwtrain.backend import Controller, Node, Program, Transfer
from pwtrain.backend.program import Latest
from pwtrain.models import decode
from pwtrain.models.sampling import pick
from pwtrain.serve.weights import Cell, Layout

TOP = 5  # most likely ids returned per token (OpenAI's largest `logprobs`)
SAMPLING = {  # per row: how its next token is picked (models/sampling.py), and its key's parts
  "temperature": np.float32,
  "top_k": np.int32,
  "top_p": np.float32,
  "seed": np.uint32,
  "count": np.int32,  # the row's tokens so far: its draw is fold_in(key(seed), count)
}


@dataclasses.dataclass(frozen=True)
class Pieces:
  """The programs of one layout (module doc); `cache_bytes`: the KV caches' device bytes."""

  layout: Layout
  max_batch: int
  max_len: int
  chunk: int
  init: Program
  prefill: Program
  decode: Program
  probe: Program
  cache_bytes: int

  def weights(self) -> dict:
    """The weights inputs of every program: each cell's published params and step."""
    cells = self.layout.cells
    return {f"weights/{i}": Latest(c.name, ("params", "step")) for i, c in enumerate(cells)}

  def probe_inputs(self) -> dict:
    return {f"weights/{i}": Latest(c.name, ("step",)) for i, c in enumerate(self.layout.cells)}


def build(
  controller: Controller, layout: Layout, *, max_batch: int, max_len: int, chunk: int,
  num_tokens: int,
) -> Pieces:  # fmt: skip
  """Compiles every piece of `layout` (module doc) for `max_batch` slots of `max_len` positions
  and prefill chunks of `chunk` tokens; `num_tokens`: the tokenizer's ids (larger ids of a
  padded vocabulary are never picked)."""
  cells = layout.cells
  chains = {"prefill": _Chain(cells, "prefill"), "decode": _Chain(cells, "decode")}
  init_nodes, probe_nodes, cache_bytes = [], [], 0
  for i, cell in enumerate(cells):
    replicated = NamedSharding(cell.mesh, PartitionSpec())
    cache_abs = _cache_abstract(cell, max_batch, max_len)
    cache_bytes += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache_abs))
    zeros = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, x.dtype), cache_abs)
    init = controller.compile(
      f"serve_init{i}", zeros, cell.island, (), out_shardings=_shardings(cache_abs)
    )
    init_nodes.append(Node(f"init{i}", init, ()))
    weights = _with(_weights_abstract(cell), cell.shardings)
    probe = controller.compile(
      f"serve_probe{i}",
      lambda w: w["step"],
      cell.island,
      ({"step": weights["step"]},),
      out_shardings=replicated,
    )
    probe_nodes.append(Node(f"probe{i}", probe, (f"weights/{i}",)))
    for kind, chain in chains.items():
      rows, length = (1, chunk) if kind == "prefill" else (max_batch, 1)
      executable = _compile_cell(
        controller, cell, i, kind, weights, cache_abs, rows, length, num_tokens
      )
      chain.add(i, executable, replicated)
  probe = Program(tuple(probe_nodes), {f"step/{i}": (f"probe{i}", 0) for i in range(len(cells))})
  caches = tuple(f"cache/{i}" for i in range(len(cells)))
  init = Program(
    tuple(init_nodes), {key: (f"init{i}", 0) for i, key in enumerate(caches)}, carried=caches
  )
  controller.wait_compiles()
  return Pieces(
    layout, max_batch, max_len, chunk, init, chains["prefill"].program(),
    chains["decode"].program(), probe, cache_bytes,
  )  # fmt: skip


def _compile_cell(controller, cell, i, kind, weights, cache_abs, rows, length, num_tokens):
  """Cell `i`'s piece of a `kind` program ("prefill" or "decode") for `rows` x `length`
  inputs: (weights, cache, inputs, positions[, slot, logits_at][, sampling]) -> (out, cache,
  step), the cache donated."""
  replicated = NamedSharding(cell.mesh, PartitionSpec())

  def host(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

  cfg = cell.fns.cfg
  inputs = (
    host((rows, length), np.int32)
    if cell.first
    else host((rows, length, cfg.d_model), jnp.dtype(cfg.dtype))
  )
  args = [weights, cache_abs, inputs, host((rows, length), np.int32)]
  if kind == "prefill":
    args += [host((1,), np.int32), host((1,), np.int32)]  # the slot; logits_at
  if cell.last:
    args.append({k: host((rows,), dtype) for k, dtype in SAMPLING.items()})
  fn = _cell_fn(cell, kind == "prefill", num_tokens)
  out = jax.eval_shape(fn, *args)[0]
  return controller.compile(
    f"serve_{kind}{i}",
    fn,
    cell.island,
    tuple(args),
    out_shardings=(jax.tree.map(lambda _: replicated, out), _shardings(cache_abs), replicated),
    donate_argnums=(1,),
  )


class _Chain:
  """A program's nodes through the cells in order, with a transfer of the activations wherever
  the next cell is on another island."""

  def __init__(self, cells, kind: str):
    self.cells, self.kind = cells, kind
    self.nodes: list = []

  def add(self, i: int, executable, replicated) -> None:
    inputs = "tokens"
    if i:
      inputs = (f"{self.kind}{i - 1}", 0)
      if self.cells[i - 1].island != self.cells[i].island:
        self.nodes.append(Transfer(f"act{i}", inputs, self.cells[i].island, replicated))
        inputs = (f"act{i}", 0)
    args = [f"weights/{i}", f"cache/{i}", inputs, "positions"]
    if self.kind == "prefill":
      args += ["slot", "logits_at"]
    if self.cells[i].last:
      args.append("sampling")
    self.nodes.append(Node(f"{self.kind}{i}", executable, tuple(args)))

  def program(self) -> Program:
    n = len(self.cells)
    outputs = {"out": (f"{self.kind}{n - 1}", 0)}
    for i in range(n):
      outputs[f"cache/{i}"] = (f"{self.kind}{i}", 1)
      outputs[f"step/{i}"] = (f"{self.kind}{i}", 2)
    return Program(tuple(self.nodes), outputs, carried=tuple(f"cache/{i}" for i in range(n)))


def _cell_fn(cell: Cell, prefill: bool, num_tokens: int):
  """(weights, cache, inputs, positions[, slot, logits_at][, sampling]) -> (out, cache, step):
  `out` the activations for the next cell, or on the last the picked tokens and their
  log-probabilities."""

  def fn(weights, cache, inputs, positions, *extra):
    model = cell.fns.module(weights["params"])
    rows, logits_at = (extra[0], extra[1]) if prefill else (None, None)
    if cell.last and logits_at is None:
      logits_at = jnp.zeros(inputs.shape[:1], jnp.int32)
    out, cache = decode.forward(model, cache, inputs, positions, rows=rows, logits_at=logits_at)
    if cell.last:
      out = _picked(out, extra[-1], num_tokens)
    return out, cache, weights["step"]

  return fn


def _picked(logits, sampling: dict, num_tokens: int) -> dict:
  keys = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(
    sampling["seed"], sampling["count"]
  )
  token = pick(
    logits, keys, sampling["temperature"], sampling["top_k"], sampling["top_p"], num_tokens
  )
  allowed = jnp.arange(logits.shape[-1]) < num_tokens
  logprobs = jax.nn.log_softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
  top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP)
  return {
    "token": token,
    "logprob": jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0],
    "top_ids": top_ids.astype(jnp.int32),
    "top_logprobs": top_logprobs,
  }


def _weights_abstract(cell: Cell) -> dict:
  return {"step": jax.ShapeDtypeStruct((), np.int32), "params": cell.fns.abstract_params}


def _cache_abstract(cell: Cell, max_batch: int, max_len: int):
  """The cell's KV cache as ShapeDtypeStructs: slots split over the island's batch axes where
  `max_batch` divides over them, else whole."""
  shapes = jax.eval_shape(
    lambda p: decode.init_cache(cell.fns.module(p), max_batch, max_len), cell.fns.abstract_params
  )
  scanned = bool(cell.fns.cfg.scan_layers)
  names = ("layers",) * scanned + ("batch", "length", "kv_heads", "head_dim")
  spread = sharding_lib.named_sharding(cell.mesh, names)
  whole = NamedSharding(cell.mesh, PartitionSpec())
  sharding = spread if _divides(spread, names.index("batch"), max_batch) else whole
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)


def _divides(sharding: NamedSharding, dim: int, size: int) -> bool:
  axes = sharding.spec[dim] if dim < len(sharding.spec) else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return size % int(np.prod([sharding.mesh.shape[a] for a in axes])) == 0


def _shardings(abstract):
  return jax.tree.map(lambda x: x.sharding, abstract)


def _with(abstract, shardings):
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
