"""A stage's computation, as compiled pieces of its cell (pieces.py).

Per cell and microbatch m (node names are "<p>:<kind><s>[.<m>]"):
  F    forward: input activation (or tokens) -> output activation
  B    backward: pulls back the next stage's activation gradient and adds the parameter
       gradients into the stage's running sums. What it differentiates through depends on
       `parallel.stage_remat` (STAGE_REMAT):
         full  B recomputes the stage's forward from its saved input (GPipe's
               re-materialisation): a stage holds one input per microbatch in flight
         none  F also returns what the stage's VJP keeps (its residuals: what model.remat
               keeps of every block; an unrolled model at remat "none" keeps every
               intermediate autodiff saves, more than XLA's fusion leaves in one program), B
               applies the VJP to them with no recomputation: a stage holds its residuals per
               microbatch in flight, and does the single device's work
       The chunks of exchange.mode="overlapped" are stages too.
  FB   on the last stage: forward, the objective's loss (objectives.py) of the microbatch's
       label columns, and backward in one piece; with a reference policy in the state (only a
       one-stage pod's, objectives.validate) also the reference's forward, for the KL
  W    parallel.schedule="zero_bubble", on every stage after the first: the parameters'
       gradient, added into the running sums, split off the stage's B (or FB), which then
       returns the input's gradient (and FB the loss statistics). W never recomputes the
       forward: at stage_remat="none" B and W share F's residuals; at "full" B, which
       recomputes the forward, also returns its VJP's residuals for W; FB always returns its
       own for W
Evaluation has its own two, compiled on first use:
  EF   forward at inference (MoE at eval capacity, no jitter): input -> output activation
  EL   on the last stage: forward and loss -> the microbatch's {"ce_sum", "z_sum", "tokens"}
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pwtrain import step as step_lib
from pwtrain.backend.outline import KEPT
from pwtrain.models import lm_loss
from pwtrain.models import moe as moe_lib
from pwtrain.parallel.pipeline.pieces import CellPieces


@dataclasses.dataclass
class Residuals:
  """How a stage's VJP goes from its F piece to its B piece (`parallel.stage_remat="none"`).

  jax.vjp's function is a pytree whose leaves are what the backward needs. Some of them are
  F's own inputs (the parameters, the input activation), matched by identity while F is
  traced: those B already takes, so F does not return them again (a copy per microbatch). F
  returns the others, `saved`, as one tuple. Both are recorded by tracing F (`save`), so B can be
  traced (`vjp`) only after F has been, in this process: compile_stage compiles F first.
  """

  treedef: Any = None
  sources: tuple = ()  # per leaf of the VJP: ("input", i) into the inputs, or ("saved", i)

  def save(self, vjp, inputs) -> tuple:
    """The VJP's leaves that are not leaves of `inputs` (F's outputs); records the rest."""
    leaves, self.treedef = jax.tree.flatten(vjp)
    flat = jax.tree.leaves(inputs)
    saved, sources = [], []
    for leaf in leaves:
      i = next((i for i, a in enumerate(flat) if a is leaf), None)
      sources.append(("saved", len(saved)) if i is None else ("input", i))
      if i is None:
        saved.append(leaf)
    self.sources = tuple(sources)
    return tuple(saved)

  def vjp(self, saved: tuple, inputs):
    """The VJP function again, from F's `saved` and the same `inputs` (B's)."""
    assert self.treedef is not None, "F is traced before B"
    flat = jax.tree.leaves(inputs)
    leaves = [flat[i] if kind == "input" else saved[i] for kind, i in self.sources]
    return jax.tree.unflatten(self.treedef, leaves)


def f_outputs(moe, stage_remat: str) -> tuple[str, ...]:
  """The names of F's outputs, in order: "act" (the output activation), "moe" (the running MoE
  stats, with MoE layers), "saved" (the VJP's residuals, at stage_remat="none")."""
  return (
    ("act",) + (("moe",) if moe is not None else ()) + (("saved",) if stage_remat == "none" else ())
  )


def compile_stage(cell: CellPieces, moe, stage_remat: str, split: bool) -> None:
  """A stage's F and B pieces, or its FB on the last stage, and with `split` (zero_bubble's
  stages after the first) its W.

  F returns the stage's output activation; B is its VJP (a first stage's tokens get no
  gradient), recomputed from F's input or rebuilt from F's residuals as `stage_remat` says
  (STAGE_REMAT, and the module docstring); FB differentiates the LM loss. With MoE layers
  (`moe` set) a stage also has its weighted aux losses: its objective is (output, aux), B's
  cotangents are (the next stage's activation gradient, 1) and FB adds its aux losses to the
  loss. F then also returns the running MoE stats (the previous stages', carried in as
  `moe_in`, plus its own), so FB's stats cover every stage and its loss_sum every stage's
  weighted aux losses. F's outputs are a tuple named by f_outputs (Piece.output).
  """
  stage, fns = cell.stage, cell.fns
  act_sharding = cell.act_abs.sharding
  moe_in = {} if stage.first or moe is None else {"moe_in": cell.moe_abs}
  argnums = (0,) if stage.first else (0, 1)  # tokens are not differentiable

  def forward(params, x):
    if moe is None:
      return fns.module(params)(x), {}
    rngs = moe_lib.jitter_rngs(moe, x)
    return fns.module(params).forward(x, train=True, rngs=rngs)

  def objective(params, x):
    out, stats = forward(params, x)
    if moe is None:
      return out, stats
    return (out, moe_lib.weighted_aux(moe, stats)), stats

  if stage.last:
    if split:
      _compile_split_fb(cell, forward, moe)
      return

    def fb_fn(state, x, labels, grads, stats, moe_in=None):
      loss_fn = _loss_fn(cell, forward, moe, labels, _reference_logits(forward, state, x))
      (total, (lm, own)), g = jax.value_and_grad(loss_fn, argnums, has_aux=True)(state["params"], x)
      if moe_in is not None:  # earlier stages' aux losses were differentiated there
        own = moe_lib.add_stats(moe_in, own)
        total = total + moe_lib.weighted_aux(moe, moe_in)
      grads = jax.tree.map(jnp.add, grads, g[0])
      stats = cell.objective.merge(stats, {"loss_sum": total, **lm, **own})
      return (grads, stats) if stage.first else (grads, stats, g[1])

    cell.compile(
      "FB",
      fb_fn,
      {
        "state": cell.state_abs,
        "x": cell.x_abs,
        "labels": cell.labels_abs,
        "grads": cell.grads_abs,
        "stats": cell.stats_abs,
        **moe_in,
      },
      out_shardings=(cell.grads_sharding, cell.sharding_of(cell.stats_abs))
      + (() if stage.first else (act_sharding,)),
      donate=("grads", "stats"),
      outputs=("grads", "stats") + (() if stage.first else ("g_in",)),
    )
    return

  keep = stage_remat == "none"
  residuals = Residuals()
  outputs = f_outputs(moe, stage_remat)
  cotangent_of = lambda g_out: g_out if moe is None else (g_out, jnp.ones((), jnp.float32))
  primals = lambda state, x: (state["params"], x)[: len(argnums)]

  def differentiated(x):
    """What B differentiates: the objective of (params, x), or of params on the first stage
    (its input is tokens)."""
    return (lambda params: objective(params, x)) if stage.first else objective

  def f_fn(state, x, moe_in=None):
    named = {}
    if keep:
      out, vjp, own = jax.vjp(differentiated(x), *primals(state, x), has_aux=True)
      named["act"] = out if moe is None else out[0]  # objective's (output, aux)
      named["saved"] = residuals.save(vjp, (state["params"], x))
    else:
      named["act"], own = forward(state["params"], x)
    if moe is not None:
      named["moe"] = own if moe_in is None else moe_lib.add_stats(moe_in, own)
    return tuple(named[name] for name in outputs)

  # KEPT: the residuals' shardings are the compiler's choice, and only B and W, on the same
  # island, read them (a process that does not run the island need not compile F for them).
  shardings = {"act": act_sharding, "moe": cell.sharding_of(cell.moe_abs), "saved": KEPT}
  f_piece = cell.compile(
    "F",
    f_fn,
    {"state": cell.state_abs, "x": cell.x_abs, **moe_in},
    out_shardings=tuple(shardings[name] for name in outputs),
    outputs=outputs,
  )

  def vjp_of(state, x, saved=None):
    """The microbatch's VJP of (params, x) (or of params, on the first stage): rebuilt from
    F's residuals `saved` (stage_remat="none"), or by running the forward again."""
    if keep:
      return residuals.vjp(saved, (state["params"], x))
    return jax.vjp(differentiated(x), *primals(state, x), has_aux=True)[1]

  def b_fn(state, x, g_out, grads, saved=None):
    g_params, *g_in = vjp_of(state, x, saved)(cotangent_of(g_out))
    return (jax.tree.map(jnp.add, grads, g_params), *g_in)

  inputs = {"state": cell.state_abs, "x": cell.x_abs, "g_out": cell.act_abs}
  if keep:
    inputs["saved"] = f_piece.out_abstract[f_piece.output("saved")]
  if split:
    _compile_split_b(cell, inputs, keep, vjp_of, cotangent_of)
    return
  cell.compile(
    "B",
    b_fn,
    {**inputs, "grads": cell.grads_abs},
    out_shardings=(cell.grads_sharding,) + (() if stage.first else (act_sharding,)),
    donate=("grads",),
    outputs=("grads",) + (() if stage.first else ("g_in",)),
  )


def _compile_split_b(cell, inputs, keep, vjp_of, cotangent_of):
  """zero_bubble's B (the input's gradient) and W (the parameters') of a stage that is not the
  last, from the stage's `vjp_of(state, x, saved)`. At stage_remat="none" both rebuild the VJP
  from F's residuals (`inputs` holding "saved"); at "full" B recomputes the forward and returns
  the VJP's residuals too (KEPT, as F's: only W on this island reads them), so W does not
  recompute it again."""
  b_residuals = Residuals()  # stage_remat="full": B's VJP's, for W

  def b_fn(state, x, g_out, saved=None):
    vjp = vjp_of(state, x, saved)
    g_in = vjp(cotangent_of(g_out))[1]
    return g_in if keep else (g_in, b_residuals.save(vjp, (state["params"], x)))

  b = cell.compile(
    "B",
    b_fn,
    inputs,
    out_shardings=cell.act_abs.sharding if keep else (cell.act_abs.sharding, KEPT),
    outputs=("g_in",) if keep else ("g_in", "saved"),
  )

  def g_params(state, x, g_out, saved):
    vjp = vjp_of(state, x, saved) if keep else b_residuals.vjp(saved, (state["params"], x))
    return vjp(cotangent_of(g_out))[0]

  if not keep:
    inputs = {**inputs, "saved": b.out_abstract[b.output("saved")]}
  _compile_w(cell, g_params, {**inputs, "grads": cell.grads_abs})


def _reference_logits(forward, state, x):
  """The reference policy's logits of the microbatch (no gradient), where the cell's state
  holds the reference (a one-stage pod's whole model: objectives.validate), else None."""
  if "reference" not in state:
    return None
  return jax.lax.stop_gradient(forward(state["reference"], x)[0])


def _loss_fn(cell, forward, moe, labels: list, reference_logits=None):
  """The last stage's objective of (params, x): the run's objective's loss (cell.objective) of
  the microbatch's `labels` (the label columns, in objective.label_columns order) plus its MoE
  aux losses, with (the objective's statistics, its own MoE stats) as aux."""
  named = dict(zip(cell.objective.label_columns, labels, strict=True))

  def loss_fn(params, x):
    out, own = forward(params, x)
    total, lm = cell.objective.loss(out, named, reference_logits)
    if moe is not None:
      total = total + moe_lib.weighted_aux(moe, own)
    return total, (lm, own)

  return loss_fn


def _compile_w(cell: CellPieces, g_params, inputs: dict) -> None:
  """W: `g_params(**inputs but grads)` (the microbatch's parameter gradient) added into the
  running sums `grads` (donated)."""

  def w_fn(grads, **rest):
    return jax.tree.map(jnp.add, grads, g_params(**rest))

  cell.compile("W", w_fn, inputs, out_shardings=cell.grads_sharding, donate=("grads",))


def _compile_split_fb(cell: CellPieces, forward, moe) -> None:
  """zero_bubble's last stage: FB (forward, loss, the input's gradient, the statistics and its
  VJP's residuals, for W) and W (the parameters' gradient from them, with no recomputation,
  whatever `parallel.stage_remat`)."""
  residuals = Residuals()
  moe_in = {} if moe is None else {"moe_in": cell.moe_abs}

  def vjp_of(state, x, labels):
    loss_fn = _loss_fn(cell, forward, moe, labels, _reference_logits(forward, state, x))
    return jax.vjp(loss_fn, state["params"], x, has_aux=True)

  def fb_fn(state, x, labels, stats, moe_in=None):
    total, vjp, (lm, own) = vjp_of(state, x, labels)
    _, g_in = vjp(jnp.ones((), total.dtype))  # XLA drops the parameters' gradient
    if moe_in is not None:  # earlier stages' aux losses were differentiated there
      own = moe_lib.add_stats(moe_in, own)
      total = total + moe_lib.weighted_aux(moe, moe_in)
    stats = cell.objective.merge(stats, {"loss_sum": total, **lm, **own})
    return stats, g_in, residuals.save(vjp, (state["params"], x))

  inputs = {"state": cell.state_abs, "x": cell.x_abs, "labels": cell.labels_abs}
  fb = cell.compile(
    "FB",
    fb_fn,
    {**inputs, "stats": cell.stats_abs, **moe_in},
    out_shardings=(cell.sharding_of(cell.stats_abs), cell.act_abs.sharding, KEPT),
    donate=("stats",),
    outputs=("stats", "g_in", "saved"),
  )

  def g_params(state, x, labels, saved):
    del labels  # in the residuals
    return residuals.vjp(saved, (state["params"], x))(jnp.ones((), jnp.float32))[0]

  inputs["saved"] = fb.out_abstract[fb.output("saved")]
  _compile_w(cell, g_params, {**inputs, "grads": cell.grads_abs})


def compile_eval(cell: CellPieces, z_loss: float) -> None:
  """The cell's EF piece, or its EL on the last stage (see the module docstring): the LM loss
  of "targets", whatever the run's objective."""

  def forward(state, x):
    return cell.fns.module(state["params"]).forward(x, train=False)[0]

  if cell.stage.last:

    def el_fn(state, x, targets):
      return lm_loss(forward(state, x), targets, z_loss=z_loss)[1]

    stats = {k: v for k, v in cell.stats_abs.items() if k in step_lib.EVAL_KEYS}
    inputs = {"state": cell.state_abs, "x": cell.x_abs, "targets": cell.tokens_abs}
    cell.compile("EL", el_fn, inputs, out_shardings=cell.sharding_of(stats))
    return
  inputs = {"state": cell.state_abs, "x": cell.x_abs}
  cell.compile("EF", forward, inputs, out_shardings=cell.act_abs.sharding)
