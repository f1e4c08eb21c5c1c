"""MPMD steps over islands: pipeline stages, data-parallel pods, or both.

Cell (p, s) is stage s of pod (replica) p, placed on its own island (overlapped exchange also
cuts a pod into several chunks on one island). Per cell and microbatch m the step has these
nodes, each compiled once for its island:
  F{s}.{m}   forward of the stage: input activation (or tokens) -> output activation
  B{s}.{m}   backward: recomputes the stage's forward from its saved input (GPipe's
             re-materialisation), pulls back the next stage's activation gradient and adds the
             parameter gradients into the stage's running sums
  FB{s}.{m}  on the last stage: forward, loss, backward in one piece
  enc/reduce with pods: compress the stage's gradients, sum all pods' (decoded) gradients in pod
             order, as soon as the stage's backward is done
  emb/finish ties the shared embedding's two gradient halves (first and last stage); the
             squared norm of the stage's gradients
  apply{s}   clip by the norm over all stages, normalise by all pods' tokens, optimizer update
plus transfers: activations forward, activation gradients backward, embedding-gradient halves,
gradients across pods, loss statistics and squared norms to every cell. Node names are prefixed
with the pod ("1:F0.3").

Each island's nodes are ordered by the schedule. GPipe: all forwards, then all backwards, so a
stage holds the inputs of all M microbatches. 1F1B: a warm-up of S-1-s forwards, then one
forward and one backward alternately, so stage s holds at most S-s. The controller enqueues
the whole step at once; each island's scheduler launches its nodes in this order as their
inputs appear.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain import guard
from pwtrain import sharding as sharding_lib
from pwtrain import step as step_lib
from pwtrain.backend import Controller, Node, Program, Transfer
from pwtrain.models import lm_loss
from pwtrain.models import moe as moe_lib
from pwtrain.parallel import exchange, spmd
from pwtrain.parallel.stages import Stage, make_stages, to_stage, to_whole

STAT_KEYS = step_lib.STAT_KEYS


def island_order(schedule: str, stage: Stage, num_stages: int, num_micro: int) -> list:
  """The compute nodes of one stage, as ("F"|"B"|"FB", microbatch), in schedule order."""
  if stage.last:
    return [("FB", m) for m in range(num_micro)]
  if schedule == "gpipe":
    return [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]
  warmup = min(num_stages - 1 - stage.index, num_micro)
  order = [("F", m) for m in range(warmup)]
  for i in range(num_micro - warmup):
    order += [("F", warmup + i), ("B", i)]
  return order + [("B", m) for m in range(num_micro - warmup, num_micro)]


def peak_live_inputs(order: list) -> int:
  """Most microbatch inputs a stage holds at once (saved at F, freed by B) under `order`."""
  live = peak = 0
  for kind, _ in order:
    live += {"F": 1, "B": -1, "FB": 0}[kind]
    peak = max(peak, live)
  return peak


@dataclasses.dataclass
class PipelineProgram:
  """The trainer's contract (see spmd.StepProgram), with one state per cell."""

  program: Program
  abstract_state: dict  # whole-model state; each leaf sharded on pod 0's island that owns it
  init: object  # () -> {"state/<p>.<s>": cell state}
  executables: dict
  stages: list
  num_pods: int
  num_micro: int
  cell_shardings: dict  # (p, s) -> state shardings
  exchange_bytes: int  # bytes each pod sends to the other pods per (outer) step
  outer_program: Program | None = None  # DiLoCo: the step that ends with the outer update
  inner_steps: int = 1
  per_pod_checkpoint: bool = False  # DiLoCo: pods differ between outer steps

  @property
  def state_keys(self) -> tuple:
    return tuple(_state_key(c) for c in self.cell_shardings)

  def program_for(self, step: int) -> Program:
    """The program of step `step` (0-based): DiLoCo's every `inner_steps`-th is the outer one."""
    if self.outer_program is not None and (step + 1) % self.inner_steps == 0:
      return self.outer_program
    return self.program

  def feed(self, batch: dict) -> dict:
    """Host batch -> per-pod, per-microbatch inputs.

    Pod p takes the p-th contiguous slice of the global batch; within it rows m, m+M, ... form
    microbatch m (as gradient accumulation does).
    """
    out = {}
    for p in range(self.num_pods):
      rows = slice(
        p * len(batch["inputs"]) // self.num_pods, (p + 1) * len(batch["inputs"]) // self.num_pods
      )
      for m in range(self.num_micro):
        out[f"tokens/{p}.{m}"] = batch["inputs"][rows][m :: self.num_micro]
        out[f"targets/{p}.{m}"] = batch["targets"][rows][m :: self.num_micro]
    return out

  def _pod_whole(self, state: dict, p: int) -> dict:
    return to_whole([state[_state_key((p, s))] for s in range(len(self.stages))], self.stages)

  def to_checkpoint(self, state: dict) -> dict:
    if self.per_pod_checkpoint:
      return {"pods": [self._pod_whole(state, p) for p in range(self.num_pods)]}
    return self._pod_whole(state, 0)  # pods hold identical states

  def from_checkpoint(self, whole: dict) -> dict:
    return {
      _state_key(cell): jax.device_put(
        to_stage(
          whole["pods"][cell[0]] if self.per_pod_checkpoint else whole, self.stages[cell[1]]
        ),
        shardings,
      )
      for cell, shardings in self.cell_shardings.items()
    }


def _state_key(cell) -> str:
  return f"state/{cell[0]}.{cell[1]}"


def cell_islands(config, plan) -> dict:
  """(pod, stage) -> island. Overlapped exchange on a single stage cuts each pod into
  `exchange.buckets` chunks that share the pod's island."""
  num_pods, num_stages = config.parallel.pods, config.parallel.stages
  if config.exchange.mode == "overlapped" and num_stages == 1 and num_pods > 1:
    chunks = min(config.exchange.buckets, config.model.num_layers)
    return {(p, s): plan.islands[p] for p in range(num_pods) for s in range(chunks)}
  return {
    (p, s): plan.islands[p * num_stages + s] for p in range(num_pods) for s in range(num_stages)
  }


def build(config, plan, controller: Controller, tx, schedule) -> PipelineProgram:
  placement = cell_islands(config, plan)
  num_pods = config.parallel.pods
  num_stages = len(placement) // num_pods
  stages = make_stages(config, num_stages)
  assert num_stages > 1 or num_pods > 1, "one stage on one island is spmd.build's job"
  num_micro = config.train.num_microbatches
  compression = config.exchange.compression if num_pods > 1 else "none"
  stale = num_pods > 1 and config.exchange.mode == "stale"
  diloco = num_pods > 1 and config.exchange.mode == "diloco"
  # Error feedback keeps what compression lost and adds it to the next step's gradients.
  feedback = compression != "none" and config.exchange.error_feedback and not diloco
  per_pod = diloco or feedback  # pods' states differ: every pod's is checkpointed
  outer_tx = exchange.outer_optimizer(config.exchange) if diloco else None

  def whole_init():
    state = step_lib.init_state(step_lib.model_fns(config.model, config.moe), tx, config.seed)
    if stale:
      state["pending"] = exchange.init_pending(state["params"], config.moe.num_experts)
    if diloco:
      state["outer"] = exchange.init_outer(state["params"], outer_tx)
    if feedback:
      state["residual"] = jax.tree.map(jnp.zeros_like, state["params"])
    return state

  whole_abstract = jax.eval_shape(whole_init)
  update = guard.wrap_update(
    step_lib.apply_update(tx, schedule, config.optim.clip_norm), config.train
  )
  # MoE: each stage adds its weighted aux losses to what it differentiates, and passes the
  # running MoE stats forward with its activations, so the last stage's stats cover all stages.
  moe = config.moe if moe_lib.enabled(config.moe) else None
  if moe:
    update = moe_lib.with_metrics(moe, update)
  if stale:
    update = exchange.stale(update)
  mb = config.train.global_batch // num_pods // num_micro
  seq = config.data.seq_len
  act_dtype = jnp.dtype(config.model.dtype)
  z_loss = config.model.z_loss

  exes, cell_shardings, cell_abstract = {}, {}, {}
  exchange_bytes = 0
  for (p, s), island in placement.items():
    stage = stages[s]
    mesh = island.mesh(plan.mesh_shape)
    fns = step_lib.model_fns(config.model, config.moe, **stage.model_kwargs())
    abstract = to_stage(whole_abstract, stage)
    shardings = spmd.state_shardings(fns, mesh, abstract)
    state_abs = spmd.with_shardings(abstract, shardings)
    cell_shardings[(p, s)], cell_abstract[(p, s)] = shardings, state_abs
    replicated = NamedSharding(mesh, PartitionSpec())
    act_sharding = sharding_lib.named_sharding(mesh, ("batch", "length", "embed"))
    tok_sharding = sharding_lib.named_sharding(mesh, ("batch", "length"))
    grads_abs, grads_sharding = state_abs["params"], shardings["params"]
    tokens_abs = jax.ShapeDtypeStruct((mb, seq), np.int32, sharding=tok_sharding)
    act_abs = jax.ShapeDtypeStruct(
      (mb, seq, config.model.d_model), act_dtype, sharding=act_sharding
    )
    x_abs = tokens_abs if stage.first else act_abs
    scalar = jax.ShapeDtypeStruct((), np.float32, sharding=replicated)

    def zero_stats():
      return {
        **{k: jnp.zeros((), jnp.float32) for k in STAT_KEYS},
        **moe_lib.zero_stats(config.moe.num_experts),
      }

    stats_abs = jax.tree.map(
      lambda a, r=replicated: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=r),
      jax.eval_shape(zero_stats),
    )
    stats_sharding = jax.tree.map(lambda _, r=replicated: r, stats_abs)
    moe_abs = {k: v for k, v in stats_abs.items() if k in moe_lib.STAT_KEYS}
    moe_sharding = {k: replicated for k in moe_abs}

    def compile_(kind, fn, args, p=p, s=s, island=island, mesh=mesh, **kw):
      name = f"{p}:{kind}{s}"
      exes[(kind, p, s)] = controller.compile(name, fn, island.name, args, mesh=mesh, **kw)

    compile_("init", lambda stage=stage: to_stage(whole_init(), stage), (), out_shardings=shardings)

    def zeros_fn(state):
      return jax.tree.map(jnp.zeros_like, state["params"]), zero_stats()

    compile_("zeros", zeros_fn, (state_abs,), out_shardings=(grads_sharding, stats_sharding))

    shapes = (state_abs, x_abs, tokens_abs, act_abs, grads_abs, stats_abs, moe_abs)
    out_shardings = (act_sharding, grads_sharding, stats_sharding, moe_sharding)
    compile_stage(compile_, stage, fns, moe, z_loss, shapes, out_shardings)

    # Pods: every pod sums the decoded gradients of all pods (its own too) in pod order.
    if num_pods > 1 and not diloco:
      parts_abs = (grads_abs,) * num_pods
      if compression != "none":
        if feedback:
          compile_(
            "enc",
            lambda g, st: exchange.encode_with_feedback(g, st["residual"], compression),
            (grads_abs, state_abs),
          )
          parts_abs = (_with_out_shardings(exes[("enc", p, s)])[0],) * num_pods
        else:
          compile_("enc", lambda g: exchange.encode(g, compression), (grads_abs,))
          parts_abs = (_with_out_shardings(exes[("enc", p, s)]),) * num_pods
      if p == 0:
        exchange_bytes += (num_pods - 1) * exchange.encoded_bytes(grads_abs, compression)

      def reduce_fn(*parts, stage=stage):
        parts = [exchange.decode(part, compression) for part in parts]
        grads = parts[0]
        for part in parts[1:]:
          grads = jax.tree.map(jnp.add, grads, part)
        # Each pod's squared gradient norm, for per-pod metrics. Under pipelining a pod's
        # embedding gradient is split in two halves; it is counted by its first-stage half.
        counted = [{k: v for k, v in g.items() if stage.first or k != "embedding"} for g in parts]
        return grads, jnp.stack([step_lib.sum_of_squares(g) for g in counted])

      compile_("reduce", reduce_fn, parts_abs, out_shardings=(grads_sharding, replicated))

    tied = num_stages > 1 and (stage.first or stage.last)
    if tied:
      emb_sharding = grads_sharding["embedding"]
      compile_("emb", lambda g: g["embedding"], (grads_abs,), out_shardings=emb_sharding)

    def finish_fn(grads, other=None, stage=stage):
      # The embedding's gradient is the sum of its use as input (first stage) and as output
      # layer (last stage); both ends add the halves in the same order, so their copies of the
      # embedding stay bitwise equal. It is counted in the norm once, on the first stage.
      if other is not None:
        own = grads["embedding"]
        grads = {**grads, "embedding": own + other if stage.first else other + own}
      counted = {k: v for k, v in grads.items() if stage.first or k != "embedding"}
      return grads, step_lib.sum_of_squares(counted)

    compile_(
      "finish",
      finish_fn,
      (grads_abs, grads_abs["embedding"]) if tied else (grads_abs,),
      out_shardings=(grads_sharding, replicated),
      donate_argnums=(0,),
    )

    # Pod 0's last stage reports the metrics, including each pod's gradient norm.
    pod_norms = num_pods > 1 and not diloco and (p, s) == (0, num_stages - 1)

    def apply_fn(state, grads, *rest, pod=p, pod_norms=pod_norms):
      if feedback:  # the residual the encoding left, kept for the next step
        state = {**state, "residual": rest[-1]}
        rest = rest[:-1]
      pod_stats, sumsqs = rest[:num_pods], rest[num_pods : num_pods + num_stages]
      stats = pod_stats[0]
      for other in pod_stats[1:]:
        stats = jax.tree.map(jnp.add, stats, other)
      if diloco:  # each pod steps on its own gradients; the metrics still cover every pod
        new_state, _ = update(state, grads, pod_stats[pod], sum(sumsqs))
        _, metrics = update(state, grads, stats, sum(sumsqs))
      else:
        new_state, metrics = update(state, grads, stats, sum(sumsqs))
      if num_pods > 1:
        for q, st in enumerate(pod_stats):
          metrics[f"pod{q}_loss"] = st["loss_sum"] / jnp.maximum(st["tokens"], 1.0)
      if pod_norms:
        per_pod = jnp.sqrt(sum(rest[num_pods + num_stages :]))
        for q, st in enumerate(pod_stats):
          metrics[f"pod{q}_grad_norm"] = per_pod[q] / jnp.maximum(st["tokens"], 1.0)
      return new_state, metrics

    if diloco:
      # Outer step: the pods' parameter deltas since the last outer step (pseudo-gradients),
      # compressed like gradients, averaged in pod order, fed to the outer optimizer.
      compile_(
        "delta",
        lambda st: exchange.encode(exchange.outer_delta(st), compression),
        (state_abs,),
      )
      delta_abs = _with_out_shardings(exes[("delta", p, s)])
      if p == 0:
        exchange_bytes += (num_pods - 1) * exchange.encoded_bytes(grads_abs, compression)

      def outer_fn(state, *deltas):
        deltas = [exchange.decode(d, compression) for d in deltas]
        return exchange.outer_update(state, deltas, outer_tx)

      compile_(
        "outer",
        outer_fn,
        (state_abs, *[delta_abs] * num_pods),
        out_shardings=shardings,
        donate_argnums=(0,),
      )

    compile_(
      "apply",
      apply_fn,
      (
        state_abs,
        grads_abs,
        *[stats_abs] * num_pods,
        *[scalar] * num_stages,
        *[jax.ShapeDtypeStruct((num_pods,), np.float32, sharding=replicated)]
        * (num_stages if pod_norms else 0),
        *([grads_abs] if feedback else []),
      ),
      out_shardings=(shardings, replicated),
      donate_argnums=(0,),
    )

  def layout(outer=False):
    return _Layout(
      stages,
      placement,
      plan,
      exes,
      num_micro,
      config.parallel.schedule,
      compression,
      diloco,
      feedback,
      moe is not None,
    ).step_program(outer)

  program = layout()
  cells = list(placement)
  init_program = Program(
    nodes=tuple(Node(f"{p}:init{s}", exes[("init", p, s)], ()) for p, s in cells),
    outputs={_state_key((p, s)): (f"{p}:init{s}", 0) for p, s in cells},
    carried=tuple(_state_key(c) for c in cells),
  )

  def init():
    out = controller.run(init_program, {})
    return {k: v.result() for k, v in out.items()}

  # Checkpoints hold the whole model; each leaf is restored onto pod 0's island of the stage
  # that owns it (shared leaves onto the first), and from_checkpoint copies it where else it
  # is used.
  pod0 = [cell_abstract[(0, s)] for s in range(num_stages)]
  whole_shardings = to_whole([jax.tree.map(lambda a: a.sharding, st) for st in pod0], stages)
  abstract_state = spmd.with_shardings(whole_abstract, whole_shardings)
  if per_pod:  # every pod's state is saved: they differ (DiLoCo, error feedback residuals)
    pods_abstract = []
    for p in range(num_pods):
      cells = [cell_abstract[(p, s)] for s in range(num_stages)]
      pod_shardings = to_whole([jax.tree.map(lambda a: a.sharding, st) for st in cells], stages)
      pods_abstract.append(spmd.with_shardings(whole_abstract, pod_shardings))
    abstract_state = {"pods": pods_abstract}
  return PipelineProgram(
    program,
    abstract_state,
    init,
    exes,
    stages,
    num_pods,
    num_micro,
    cell_shardings,
    exchange_bytes,
    outer_program=layout(outer=True) if diloco else None,
    inner_steps=config.exchange.inner_steps if diloco else 1,
    per_pod_checkpoint=per_pod,
  )


def compile_stage(compile_, stage, fns, moe, z_loss, shapes, out_shardings):
  """A stage's F and B nodes, or its FB on the last stage.

  F returns the stage's output activation; B is its VJP (a first stage's tokens get no
  gradient); FB differentiates the LM loss. With MoE layers (`moe` set) a stage also has its
  weighted aux losses: its objective is (output, aux), B's cotangents are (the next stage's
  activation gradient, 1) and FB adds its aux losses to the loss. F then also returns the running
  MoE stats (the previous stages', carried in as its last argument, plus its own), so FB's stats
  cover every stage and its loss_sum every stage's weighted aux losses.
  """
  state_abs, x_abs, tokens_abs, act_abs, grads_abs, stats_abs, moe_abs = shapes
  act_sharding, grads_sharding, stats_sharding, moe_sharding = out_shardings
  carried_abs = () if stage.first or moe is None else (moe_abs,)
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

    def fb_fn(state, x, targets, grads, stats, *carried):
      def loss_fn(params, x):
        out, own = forward(params, x)
        total, lm = lm_loss(out, targets, z_loss=z_loss)
        if moe is not None:
          total = total + moe_lib.weighted_aux(moe, own)
        return total, (lm, own)

      (total, (lm, own)), g = jax.value_and_grad(loss_fn, argnums, has_aux=True)(state["params"], x)
      for before in carried:  # earlier stages' aux losses were differentiated there
        own = moe_lib.add_stats(before, own)
        total = total + moe_lib.weighted_aux(moe, before)
      grads = jax.tree.map(jnp.add, grads, g[0])
      stats = jax.tree.map(jnp.add, stats, {"loss_sum": total, **lm, **own})
      return (grads, stats) if stage.first else (grads, stats, g[1])

    compile_(
      "FB",
      fb_fn,
      (state_abs, x_abs, tokens_abs, grads_abs, stats_abs, *carried_abs),
      out_shardings=(grads_sharding, stats_sharding) + (() if stage.first else (act_sharding,)),
      donate_argnums=(3, 4),
    )
    return

  def f_fn(state, x, *carried):
    out, own = forward(state["params"], x)
    if moe is None:
      return out
    for before in carried:
      own = moe_lib.add_stats(before, own)
    return out, own

  compile_(
    "F",
    f_fn,
    (state_abs, x_abs, *carried_abs),
    out_shardings=act_sharding if moe is None else (act_sharding, moe_sharding),
  )

  def b_fn(state, x, g_out, grads):
    cotangent = g_out if moe is None else (g_out, jnp.ones((), jnp.float32))
    fn = objective if not stage.first else lambda params: objective(params, x)
    primals = (state["params"], x)[: len(argnums)]
    _, vjp, _ = jax.vjp(fn, *primals, has_aux=True)
    g_params, *g_in = vjp(cotangent)
    return (jax.tree.map(jnp.add, grads, g_params), *g_in)

  compile_(
    "B",
    b_fn,
    (state_abs, x_abs, act_abs, grads_abs),
    out_shardings=(grads_sharding,) + (() if stage.first else (act_sharding,)),
    donate_argnums=(3,),
  )


def _with_out_shardings(exe):
  return jax.tree.map(
    lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
    exe.compiled.out_info,
    exe.compiled.output_shardings,
  )


class _Layout:
  """Builds the step's nodes cell by cell, then interleaves them into one dispatch order."""

  def __init__(
    self, stages, placement, plan, exes, num_micro, schedule, compression, diloco, feedback, moe
  ):
    self.stages, self.placement, self.exes, self.diloco = stages, placement, exes, diloco
    self.feedback, self.moe = feedback, moe
    self.meshes = {c: island.mesh(plan.mesh_shape) for c, island in placement.items()}
    self.num_micro, self.schedule, self.compression = num_micro, schedule, compression
    self.per_cell: dict = {c: [] for c in placement}

  def _move(self, cell, name, src, names=None, sharding=None):
    """Transfer `src` onto `cell`'s island, sharded by logical `names` (or `sharding`)."""
    if sharding is None:
      sharding = sharding_lib.named_sharding(self.meshes[cell], names)
    self.per_cell[cell].append(Transfer(name, src, self.placement[cell].name, sharding))
    return (name, 0)

  def _node(self, cell, name, kind, *args):
    self.per_cell[cell].append(Node(name, self.exes[(kind, *cell)], args))
    return name

  def step_program(self, outer: bool = False) -> Program:
    num_stages, last = len(self.stages), len(self.stages) - 1
    pods = sorted({p for p, _ in self.placement})
    act, tokens = ("batch", "length", "embed"), ("batch", "length")
    grads_ref, stats_ref = {}, {}
    for p, s in self.placement:
      stage, cell, state = self.stages[s], (p, s), _state_key((p, s))
      pre = f"{p}:"
      self._node(cell, f"{pre}zeros{s}", "zeros", state)
      grads, stats = (f"{pre}zeros{s}", 0), (f"{pre}zeros{s}", 1)
      for kind, m in island_order(self.schedule, stage, num_stages, self.num_micro):
        if kind == "B":
          x = (f"{pre}tok{m}", 0) if stage.first else (f"{pre}act{s}.{m}", 0)
          src = (f"{pre}FB{last}.{m}", 2) if s + 1 == last else (f"{pre}B{s + 1}.{m}", 1)
          g = self._move(cell, f"{pre}grad{s}.{m}", src, act)
          grads = (self._node(cell, f"{pre}B{s}.{m}", "B", state, x, g, grads), 0)
          continue
        carried = []  # MoE: the running MoE stats of the stages before
        if stage.first:
          x = self._move(cell, f"{pre}tok{m}", f"tokens/{p}.{m}", tokens)
        else:
          x = self._move(cell, f"{pre}act{s}.{m}", (f"{pre}F{s - 1}.{m}", 0), act)
          if self.moe:
            carried = [self._move(cell, f"{pre}moe{s}.{m}", (f"{pre}F{s - 1}.{m}", 1), ())]
        if kind == "F":
          self._node(cell, f"{pre}F{s}.{m}", "F", state, x, *carried)
        else:
          y = self._move(cell, f"{pre}tgt{m}", f"targets/{p}.{m}", tokens)
          name = self._node(cell, f"{pre}FB{s}.{m}", "FB", state, x, y, grads, stats, *carried)
          grads, stats = (name, 0), (name, 1)
      grads_ref[cell] = grads
      if stage.last:
        stats_ref[p] = stats

    # Across pods: stage s of every pod receives stage s's gradients of every pod, as soon as
    # that stage's backward is done (the interleaving below dispatches it right then).
    residual = {}
    if len(pods) > 1 and not self.diloco:
      for p, s in self.placement:
        if self.feedback:
          name = self._node((p, s), f"{p}:enc{s}", "enc", grads_ref[(p, s)], _state_key((p, s)))
          grads_ref[(p, s)], residual[(p, s)] = (name, 0), (name, 1)
        elif self.compression != "none":
          grads_ref[(p, s)] = (self._node((p, s), f"{p}:enc{s}", "enc", grads_ref[(p, s)]), 0)
      sent = dict(grads_ref)
      for p, s in self.placement:
        cell, parts = (p, s), []
        for q in pods:
          if q == p:
            parts.append(sent[cell])
          else:
            sharding = self.exes[("reduce", p, s)].compiled.input_shardings[0][len(parts)]
            parts.append(self._move(cell, f"{q}>{p}:g{s}", sent[(q, s)], sharding=sharding))
        grads_ref[cell] = (self._node(cell, f"{p}:reduce{s}", "reduce", *parts), 0)

    # The shared embedding: each end sends its (pod-summed) half of the gradient to the other.
    for p, s in self.placement:
      if num_stages > 1 and s in (0, last):
        self._node((p, s), f"{p}:emb{s}", "emb", grads_ref[(p, s)])
    for p, s in self.placement:
      cell, pre, args = (p, s), f"{p}:", [grads_ref[(p, s)]]
      if num_stages > 1 and s in (0, last):
        other = last if s == 0 else 0
        args.append(
          self._move(cell, f"{pre}emb{other}to{s}", (f"{pre}emb{other}", 0), ("vocab", "embed"))
        )
      self._node(cell, f"{pre}finish{s}", "finish", *args)

    # Every cell clips by the same global norm and normalises by the same token count.
    for p, s in self.placement:
      cell, pre = (p, s), f"{p}:"
      sumsqs = [
        (f"{pre}finish{t}", 1)
        if t == s
        else self._move(cell, f"{pre}sq{t}to{s}", (f"{pre}finish{t}", 1), ())
        for t in range(num_stages)
      ]
      pod_stats = [
        stats_ref[q]
        if (q, last) == cell
        else self._move(cell, f"{q}>{p}:stats{s}", stats_ref[q], ())
        for q in pods
      ]
      norms = []
      if cell == (0, last) and len(pods) > 1 and not self.diloco:
        norms = [
          (f"0:reduce{t}", 1) if t == s else self._move(cell, f"0:pn{t}", (f"0:reduce{t}", 1), ())
          for t in range(num_stages)
        ]
      self._node(
        cell,
        f"{pre}apply{s}",
        "apply",
        _state_key(cell),
        (f"{pre}finish{s}", 0),
        *pod_stats,
        *sumsqs,
        *norms,
        *([residual[cell]] if self.feedback else []),
      )
    final = {c: (f"{c[0]}:apply{c[1]}", 0) for c in self.placement}
    if outer:  # DiLoCo: every pod sends its delta; each averages them and steps the anchor
      for p, s in self.placement:
        self._node((p, s), f"{p}:delta{s}", "delta", final[(p, s)])
      for p, s in self.placement:
        cell, parts = (p, s), []
        for q in pods:
          if q == p:
            parts.append((f"{p}:delta{s}", 0))
          else:
            sharding = self.exes[("outer", p, s)].compiled.input_shardings[0][1 + len(parts)]
            parts.append(self._move(cell, f"{q}>{p}:d{s}", (f"{q}:delta{s}", 0), sharding=sharding))
        final[cell] = (self._node(cell, f"{p}:outer{s}", "outer", final[cell], *parts), 0)
    return Program(
      nodes=self._interleave(),
      outputs={
        **{_state_key(c): ref for c, ref in final.items()},
        "metrics": (f"0:apply{last}", 1),
      },
      carried=tuple(_state_key(c) for c in self.placement),
    )

  def _interleave(self) -> tuple:
    """One dispatch order that keeps each cell's order and puts producers before consumers."""
    queues = [list(q) for q in self.per_cell.values()]
    emitted: set[str] = set()
    order = []
    while any(queues):
      progressed = False
      for q in queues:
        while q and all(isinstance(r, str) or r[0] in emitted for r in _refs(q[0])):
          node = q.pop(0)
          order.append(node)
          emitted.add(node.name)
          progressed = True
      assert progressed, "schedule deadlock: no island can make progress"
    return tuple(order)


def _refs(node):
  return node.args if isinstance(node, Node) else (node.src,)
