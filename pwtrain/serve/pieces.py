"""The serving engine's compiled pieces for one layout of the weights (weights.Layout), and the
programs it runs through the controller. Their shapes never change, so nothing recompiles
whatever the requests are.

Slots. Each cell holds a KV cache of `max_batch` slots x `max_len` positions for its layers
(models/decode.py), on its island (the slots split over the island's batch axes where they
divide, else held whole), and the last cell holds each slot's newest token (`last`), which the
next decode feeds: so the engine dispatches a decode without waiting for the one before it, and
reads the tokens afterwards. A sequence holds one slot from its prefill to its last token.

  init      zeros into every cell's cache and `last`.
  prefill   one chunk of `length` tokens of each of `rows` sequences, row r into its slot
            `slot[r]` (cache rows `slot`, distinct), right-padded; a row's last chunk (`final`)
            picks its sequence's next token from its last position and puts it in its slot's
            `last`. With `score` (an echo with logprobs) on any row, it also gives each
            position's log-probability of `targets` (the prompt's next token) and the TOP most
            likely ids' (the head over every position of every row, in a branch that runs only
            then). One program per row count of `prefill_rows` (2, 4, ... up to max_batch,
            and max_batch) and length of `prefill_lengths` (the chunk, a quarter of it, ...):
            the engine pads its rows to the next row count, each padding row at the scratch
            position (below) of a slot no other row uses, not final, and its pieces to the
            shortest length that holds the longest, so that a short prompt's prefill costs a
            short program, not a whole chunk's.
  decode    one token of every slot at its own position, fed its `last`; the slots that are not
            decoding (`active` false: free, or between prefill chunks) keep their `last` and are
            fed at position max_len - 1, a scratch position that no sequence uses (a sequence of
            n prompt tokens and m new ones fills positions 0 .. n + m - 2 <= max_len - 2: the
            requests module keeps n + m <= max_len).
  probe     each cell's published step (whether the weights are there yet).

A program runs the cells in layer order, each on its own island reading its weights where they
are published (program.Latest) and its own cache: one node for one cell; for a pipeline, one
node per stage with the activations (and, for a decode, `last` to the first stage) moved
between islands by the controller's transfers. The last cell picks the next token of every row
by the rule of models/sampling.py with the row's own settings (sampling.pick), and gives its
log-probability and the `TOP` most likely ids' (the model's distribution, before temperature,
top-k and top-p), and its log-probability under the distribution it was drawn from
(`sampled_logprob`: temperature, top-k and top-p applied, sampling.sampled_logits; RL's
behaviour log-probability). Every cell returns the step of the weights it read.
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
from pwtrain.models.sampling import pick, sampled_logits
from pwtrain.serve.weights import Cell, Layout

TOP = 5  # most likely ids returned per token (OpenAI's largest `logprobs`)
SHORTEST = 16  # the shortest prefill program's tokens a row (unless the chunk is shorter)
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
  prefill: dict  # (rows, length) -> that prefill program (prefill_rows x prefill_lengths)
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
  last_cell = cells[-1]
  chains = {("decode", max_batch, 1): _Chain(cells, "decode")}
  chains |= {
    ("prefill", rows, length): _Chain(cells, "prefill")
    for rows in prefill_rows(max_batch) for length in prefill_lengths(chunk)
  }  # fmt: skip
  init_nodes, probe_nodes, cache_bytes = [], [], 0
  last_abs = jax.ShapeDtypeStruct((max_batch,), np.int32, sharding=_replicated(last_cell))
  for i, cell in enumerate(cells):
    cache_abs = _cache_abstract(cell, max_batch, max_len)
    cache_bytes += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache_abs))
    init = controller.compile(
      f"serve_init{i}", functools.partial(_zeros, cache_abs), cell.island, (),
      out_shardings=_shardings(cache_abs),
    )  # fmt: skip
    init_nodes.append(Node(f"init{i}", init, ()))
    weights = _with(_weights_abstract(cell), cell.shardings)
    probe = controller.compile(
      f"serve_probe{i}", lambda w: w["step"], cell.island, ({"step": weights["step"]},),
      out_shardings=_replicated(cell),
    )  # fmt: skip
    probe_nodes.append(Node(f"probe{i}", probe, (f"weights/{i}",)))
    for (kind, rows, length), chain in chains.items():
      shapes = _Shapes(kind, rows, length, weights, cache_abs, last_abs)
      chain.add(i, _compile_cell(controller, cell, i, shapes, num_tokens))
  init_last = controller.compile(
    "serve_init_last", functools.partial(_zeros, last_abs), last_cell.island, (),
    out_shardings=last_abs.sharding,
  )  # fmt: skip
  init_nodes.append(Node("init_last", init_last, ()))
  caches = tuple(f"cache/{i}" for i in range(len(cells)))
  init_outputs = {key: (f"init{i}", 0) for i, key in enumerate(caches)}
  init = Program(tuple(init_nodes), {**init_outputs, "last": ("init_last", 0)}, (*caches, "last"))
  probe = Program(tuple(probe_nodes), {f"step/{i}": (f"probe{i}", 0) for i in range(len(cells))})
  controller.wait_compiles()
  prefill = {tuple(k): chain.program() for (kind, *k), chain in chains.items() if kind == "prefill"}
  decode_program = chains["decode", max_batch, 1].program()
  return Pieces(
    layout, max_batch, max_len, chunk, init, prefill, decode_program, probe, cache_bytes
  )


def prefill_rows(max_batch: int) -> tuple:
  """The row counts of the prefill programs: the powers of two from 2 below `max_batch`, and
  it. Never 1 row where there are 2 slots: a one-row program multiplies its last position by
  the output layer as a matrix-vector product, which rounds otherwise than the matrix product
  of more rows, or of the training forward (docs/models.md: invariant attention)."""
  return (*(2**i for i in range(1, max_batch.bit_length()) if 2**i < max_batch), max_batch)


def prefill_lengths(chunk: int) -> tuple:
  """The lengths of the prefill programs, shortest first: `chunk`, and a quarter of the one
  before while that is at least SHORTEST tokens (a chunk of 64: 16 and 64). A chunk is padded
  to the shortest that holds it: at most 4 times its tokens, or SHORTEST."""
  lengths = [chunk]
  while lengths[-1] // 4 >= SHORTEST:
    lengths.append(lengths[-1] // 4)
  return tuple(reversed(lengths))


@dataclasses.dataclass(frozen=True)
class _Shapes:
  """The abstract arguments of one kind of program: `rows` x `length` tokens a cell."""

  kind: str  # "prefill" or "decode"
  rows: int  # a decode's: max_batch
  length: int  # a decode's: 1
  weights: dict
  cache: object
  last: jax.ShapeDtypeStruct


def _compile_cell(controller, cell: Cell, i: int, shapes: _Shapes, num_tokens: int):
  """Cell `i`'s piece of a `shapes.kind` program, its arguments in `_Chain.add`'s order:
  (weights, cache, inputs, positions[, slot][, logits_at, final][, active], [sampling, last])
  -> (out, cache, step[, last]), the cache donated."""
  replicated = _replicated(cell)

  def host(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

  rows, length, prefill = shapes.rows, shapes.length, shapes.kind == "prefill"
  cfg = cell.fns.cfg
  if not cell.first:
    inputs = host((rows, length, cfg.d_model), jnp.dtype(cfg.dtype))
  else:
    inputs = host((rows, length), np.int32) if prefill else host((rows,), np.int32)
  args = [shapes.weights, shapes.cache, inputs, host((rows, length), np.int32)]
  if prefill:
    args.append(host((rows,), np.int32))  # the slots
  if cell.last:
    if prefill:
      args += [host((rows,), np.int32), host((rows,), np.bool_)]  # logits_at; final
      args += [host((rows, length), np.int32), host((rows,), np.bool_)]  # targets; score
    else:
      args.append(host((rows,), np.bool_))  # active
    args += [{k: host((rows,), dtype) for k, dtype in SAMPLING.items()}, shapes.last]
  fn = _cell_fn(cell, prefill, num_tokens)
  outs = jax.eval_shape(fn, *args)
  out_shardings = [jax.tree.map(lambda _: replicated, outs[0]), _shardings(shapes.cache)]
  out_shardings += [replicated] * (len(outs) - 2)
  name = f"serve_{shapes.kind}{i}" + (f"x{rows}x{length}" if prefill else "")
  return controller.compile(
    name, fn, cell.island, tuple(args), out_shardings=tuple(out_shardings),
    donate_argnums=(1,),
  )  # fmt: skip


class _Chain:
  """A program's nodes through the cells in order, with a transfer wherever the next cell is on
  another island (the activations; for a decode, `last` to the first cell)."""

  def __init__(self, cells, kind: str):
    self.cells, self.kind = cells, kind
    self.nodes: list = []

  def add(self, i: int, executable) -> None:
    cell, prefill = self.cells[i], self.kind == "prefill"
    if i:
      inputs = (f"{self.kind}{i - 1}", 0)
      inputs = self._moved(f"act{i}", inputs, self.cells[i - 1].island, cell.island)
    elif prefill:
      inputs = "tokens"
    else:  # each slot's newest token, from the last cell's island
      inputs = self._moved("last_in", "last", self.cells[-1].island, cell.island)
    args = [f"weights/{i}", f"cache/{i}", inputs, "positions"]
    if prefill:
      args.append("slot")
    if cell.last:
      args += ["logits_at", "final", "targets", "score"] if prefill else ["active"]
      args += ["sampling", "last"]
    self.nodes.append(Node(f"{self.kind}{i}", executable, tuple(args)))

  def _moved(self, name: str, ref, source: str, island: str):
    if source == island:
      return ref
    target = next(c for c in self.cells if c.island == island)
    self.nodes.append(Transfer(name, ref, island, _replicated(target)))
    return (name, 0)

  def program(self) -> Program:
    n = len(self.cells)
    last = f"{self.kind}{n - 1}"
    outputs = {"out": (last, 0), "last": (last, 3)}
    for i in range(n):
      outputs[f"cache/{i}"] = (f"{self.kind}{i}", 1)
      outputs[f"step/{i}"] = (f"{self.kind}{i}", 2)
    carried = (*(f"cache/{i}" for i in range(n)), "last")
    return Program(tuple(self.nodes), outputs, carried=carried)


def _cell_fn(cell: Cell, prefill: bool, num_tokens: int):
  """The function of one cell's node (its arguments: _compile_cell). The first cell takes
  token ids (a decode: each slot's `last`, one each), later ones the activations; the last
  picks the next tokens and updates `last`."""

  def fn(weights, cache, inputs, positions, *extra):
    model = cell.fns.module(weights["params"])
    rows = extra[0] if prefill else None
    if cell.first and not prefill:
      inputs = inputs[:, None]
    if prefill and cell.last:  # the hidden states of every position: scored when asked
      model.has_head = False
      hidden, cache = decode.forward(model, cache, inputs, positions, rows=rows)
      model.has_head = True
      at = jnp.take_along_axis(hidden, extra[1][:, None, None], axis=1)  # as forward takes it
      out = model.head(at)[:, 0]
    else:
      logits_at = None if not cell.last else jnp.zeros(positions.shape[:1], jnp.int32)
      out, cache = decode.forward(model, cache, inputs, positions, rows=rows, logits_at=logits_at)
    if not cell.last:
      return out, cache, weights["step"]
    sampling, last = extra[-2], extra[-1]
    picked = _picked(out, sampling, num_tokens)
    if prefill:  # each final chunk's token becomes its slot's newest
      targets, score = extra[3], extra[4]
      picked["scores"] = jax.lax.cond(
        jnp.any(score), lambda h: _scores(model.head(h), targets, num_tokens),
        lambda h: _scores(None, targets, num_tokens), hidden,
      )  # fmt: skip
      final = extra[2]
      last = last.at[rows].set(jnp.where(final, picked["token"], last[rows]))
    else:  # the decoding slots' tokens become their newest; the others keep theirs
      last = jnp.where(extra[0], picked["token"], last)
    return picked, cache, weights["step"], last

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
  # The token's log-probability under the distribution it was drawn from (RL's behaviour
  # policy): the ids past num_tokens, then temperature, top_k and top_p as `pick` applies them.
  drawn_from = jax.nn.log_softmax(
    sampled_logits(
      logits, sampling["temperature"], sampling["top_k"], sampling["top_p"], num_tokens
    ),
    axis=-1,
  )
  return {
    "token": token,
    "logprob": jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0],
    "sampled_logprob": jnp.take_along_axis(drawn_from, token[:, None], axis=-1)[:, 0],
    "top_ids": top_ids.astype(jnp.int32),
    "top_logprobs": top_logprobs,
  }


def _scores(logits, targets, num_tokens: int) -> dict:
  """Each position's log-probability of `targets` (the token after it; [rows, length]) and its
  TOP most likely ids' (an echo's prompt log-probs); zeros without `logits` (the branch that
  skips the head)."""
  shape = targets.shape
  if logits is None:
    return {"logprob": jnp.zeros(shape, jnp.float32),
            "top_ids": jnp.zeros((*shape, TOP), jnp.int32),
            "top_logprobs": jnp.zeros((*shape, TOP), jnp.float32)}  # fmt: skip
  allowed = jnp.arange(logits.shape[-1]) < num_tokens
  logprobs = jax.nn.log_softmax(jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf), -1)
  top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP)
  return {
    "logprob": jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0],
    "top_ids": top_ids.astype(jnp.int32),
    "top_logprobs": top_logprobs,
  }


def _zeros(abstract):
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)


def _replicated(cell: Cell) -> NamedSharding:
  return NamedSharding(cell.mesh, PartitionSpec())


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
