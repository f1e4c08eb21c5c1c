"""MPMD pipelining: each stage on its own island, one program of compiled pieces per step.

Per stage s and microbatch m the step has these nodes, each compiled once for its island:
  F{s}.{m}   forward of the stage: input activation (or tokens) -> output activation
  B{s}.{m}   backward: recomputes the stage's forward from its saved input (GPipe's
             re-materialisation), pulls back the next stage's activation gradient and adds the
             parameter gradients into the stage's running sums
  FB{s}.{m}  on the last stage: forward, loss, backward in one piece
  finish{s}  ties the shared embedding's two gradient halves; squared norm of the stage's grads
  apply{s}   clip by the norm over all stages, normalise by tokens, optimizer update
plus transfers: activations forward, activation gradients backward, the embedding-gradient
halves between the first and last stage, loss statistics and squared norms to every stage.

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

from pwtrain import step as step_lib
from pwtrain.backend import Controller, Node, Program, Transfer
from pwtrain.models import lm_loss
from pwtrain.parallel import sharding as sharding_lib
from pwtrain.parallel import spmd
from pwtrain.parallel.stages import Stage, make_stages, to_stage, to_whole

STAT_KEYS = ("loss_sum", "ce_sum", "z_sum", "tokens")


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
  """The trainer's contract (see spmd.StepProgram), with one state per stage."""

  program: Program
  abstract_state: dict  # whole-model state; each leaf sharded on the island that owns it
  init: object  # () -> {"state/<s>": stage state}
  executables: dict
  stages: list
  state_keys: tuple
  stage_shardings: list
  num_micro: int

  def feed(self, batch: dict) -> dict:
    """Host batch -> per-microbatch inputs; rows m, m+M, ... form microbatch m (as accumulate)."""
    out = {}
    for m in range(self.num_micro):
      out[f"tokens/{m}"] = batch["inputs"][m :: self.num_micro]
      out[f"targets/{m}"] = batch["targets"][m :: self.num_micro]
    return out

  def to_checkpoint(self, state: dict) -> dict:
    return to_whole([state[k] for k in self.state_keys], self.stages)

  def from_checkpoint(self, whole: dict) -> dict:
    return {
      key: jax.device_put(to_stage(whole, stage), shardings)
      for key, stage, shardings in zip(
        self.state_keys, self.stages, self.stage_shardings, strict=True
      )
    }


def build(config, plan, controller: Controller, tx, schedule) -> PipelineProgram:
  stages = make_stages(config)
  assert len(stages) >= 2, "a pipeline has at least two stages"
  num_stages, num_micro = len(stages), config.train.num_microbatches
  islands = plan.islands[:num_stages]
  meshes = [island.mesh(plan.mesh_shape) for island in islands]
  whole_init = lambda: step_lib.init_state(step_lib.model_fns(config.model), tx, config.seed)
  whole_abstract = jax.eval_shape(whole_init)
  update = step_lib.apply_update(tx, schedule, config.optim.clip_norm)
  mb, seq = config.train.global_batch // num_micro, config.data.seq_len
  act_dtype = jnp.dtype(config.model.dtype)
  z_loss = config.model.z_loss

  exes, stage_shardings, stage_abstract = {}, [], []
  for stage, island, mesh in zip(stages, islands, meshes, strict=True):
    s = stage.index
    fns = step_lib.model_fns(config.model, **stage.model_kwargs())
    abstract = to_stage(whole_abstract, stage)
    shardings = spmd.state_shardings(fns, tx, mesh, abstract)
    state_abs = spmd.with_shardings(abstract, shardings)
    stage_shardings.append(shardings)
    stage_abstract.append(state_abs)
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
    stats_abs = {k: scalar for k in STAT_KEYS}
    stats_sharding = {k: replicated for k in STAT_KEYS}

    def compile_(kind, fn, args, s=s, island=island, mesh=mesh, **kw):
      exes[(kind, s)] = controller.compile(f"{kind}{s}", fn, island.name, args, mesh=mesh, **kw)

    compile_("init", lambda stage=stage: to_stage(whole_init(), stage), (), out_shardings=shardings)

    def zeros_fn(state):
      return jax.tree.map(jnp.zeros_like, state["params"]), {k: jnp.zeros(()) for k in STAT_KEYS}

    compile_("zeros", zeros_fn, (state_abs,), out_shardings=(grads_sharding, stats_sharding))

    def forward(params, x, fns=fns):
      return fns.module(params)(x)

    if stage.last:

      def fb_fn(state, x, targets, grads, stats, forward=forward, first=stage.first):
        def loss_fn(params, x):
          return lm_loss(forward(params, x), targets, z_loss=z_loss)

        argnums = (0,) if first else (0, 1)
        (total, st), g = jax.value_and_grad(loss_fn, argnums, has_aux=True)(state["params"], x)
        grads = jax.tree.map(jnp.add, grads, g[0])
        stats = jax.tree.map(jnp.add, stats, {"loss_sum": total, **st})
        return (grads, stats) if first else (grads, stats, g[1])

      compile_(
        "FB",
        fb_fn,
        (state_abs, x_abs, tokens_abs, grads_abs, stats_abs),
        out_shardings=(grads_sharding, stats_sharding) + (() if stage.first else (act_sharding,)),
        donate_argnums=(3, 4),
      )
    else:
      compile_(
        "F",
        lambda state, x, forward=forward: forward(state["params"], x),
        (state_abs, x_abs),
        out_shardings=act_sharding,
      )

      def b_fn(state, x, g_out, grads, forward=forward, first=stage.first):
        if first:  # tokens are not differentiable
          _, vjp = jax.vjp(lambda p: forward(p, x), state["params"])
          (g_params,) = vjp(g_out)
          return (jax.tree.map(jnp.add, grads, g_params),)
        _, vjp = jax.vjp(forward, state["params"], x)
        g_params, g_in = vjp(g_out)
        return jax.tree.map(jnp.add, grads, g_params), g_in

      compile_(
        "B",
        b_fn,
        (state_abs, x_abs, act_abs, grads_abs),
        out_shardings=(grads_sharding,) + (() if stage.first else (act_sharding,)),
        donate_argnums=(3,),
      )

    tied = num_stages > 1 and (stage.first or stage.last)
    if tied:
      emb_sharding = grads_sharding["embedding"]
      compile_("emb", lambda g: g["embedding"], (grads_abs,), out_shardings=emb_sharding)

    def finish_fn(grads, other=None, stage=stage):
      # The embedding's gradient is the sum of its use as input (first stage) and as output
      # layer (last stage); both ends add the halves in the same order, so their copies of the
      # embedding stay bitwise equal. Only the first stage counts it in the norm.
      if other is not None:
        own = grads["embedding"]
        grads = {**grads, "embedding": own + other if stage.first else other + own}
      counted = {k: v for k, v in grads.items() if stage.first or k != "embedding"}
      return grads, step_lib.sum_of_squares(counted)

    finish_args = (grads_abs, grads_abs["embedding"]) if tied else (grads_abs,)
    compile_(
      "finish",
      finish_fn,
      finish_args,
      out_shardings=(grads_sharding, replicated),
      donate_argnums=(0,),
    )

    def apply_fn(state, grads, stats, *sumsqs):
      return update(state, grads, stats, sum(sumsqs))

    compile_(
      "apply",
      apply_fn,
      (state_abs, grads_abs, stats_abs, *[scalar] * num_stages),
      out_shardings=(shardings, replicated),
      donate_argnums=(0,),
    )

  layout = _Layout(stages, islands, meshes, exes, num_micro, config.parallel.schedule)
  program = layout.step_program()
  state_keys = tuple(f"state/{s}" for s in range(num_stages))
  init_program = Program(
    nodes=tuple(Node(f"init{s}", exes[("init", s)], ()) for s in range(num_stages)),
    outputs={k: (f"init{s}", 0) for s, k in enumerate(state_keys)},
    carried=state_keys,
  )

  def init():
    out = controller.run(init_program, {})
    return {k: out[k].result() for k in state_keys}

  # Checkpoints hold the whole model; each leaf is restored onto the island of the stage that
  # owns it (shared leaves onto the first), and from_checkpoint copies it where else it is used.
  whole_shardings = to_whole(
    [jax.tree.map(lambda a: a.sharding, st) for st in stage_abstract], stages
  )
  abstract_state = spmd.with_shardings(whole_abstract, whole_shardings)
  return PipelineProgram(
    program, abstract_state, init, exes, stages, state_keys, stage_shardings, num_micro
  )


class _Layout:
  """Builds the step's nodes island by island, then interleaves them into one dispatch order."""

  def __init__(self, stages, islands, meshes, exes, num_micro, schedule):
    self.stages, self.islands, self.meshes = stages, islands, meshes
    self.exes, self.num_micro, self.schedule = exes, num_micro, schedule
    self.per_island: list[list] = [[] for _ in stages]

  def _move(self, s, name, src, names):
    sharding = sharding_lib.named_sharding(self.meshes[s], names)
    self.per_island[s].append(Transfer(name, src, self.islands[s].name, sharding))
    return (name, 0)

  def _node(self, s, name, kind, *args):
    self.per_island[s].append(Node(name, self.exes[(kind, s)], args))
    return name

  def step_program(self) -> Program:
    num_stages, last = len(self.stages), len(self.stages) - 1
    act, tokens = ("batch", "length", "embed"), ("batch", "length")
    grads_ref = {}
    for stage in self.stages:
      s, state = stage.index, f"state/{stage.index}"
      self._node(s, f"zeros{s}", "zeros", state)
      grads, stats = (f"zeros{s}", 0), (f"zeros{s}", 1)
      for kind, m in island_order(self.schedule, stage, num_stages, self.num_micro):
        if kind == "B":
          x = (f"tok{m}", 0) if stage.first else (f"act{s}.{m}", 0)
          src = (f"FB{last}.{m}", 2) if s + 1 == last else (f"B{s + 1}.{m}", 1)
          g = self._move(s, f"grad{s}.{m}", src, act)
          grads = (self._node(s, f"B{s}.{m}", "B", state, x, g, grads), 0)
          continue
        if stage.first:
          x = self._move(s, f"tok{m}", f"tokens/{m}", tokens)
        else:
          x = self._move(s, f"act{s}.{m}", (f"F{s - 1}.{m}", 0), act)
        if kind == "F":
          self._node(s, f"F{s}.{m}", "F", state, x)
        else:
          y = self._move(s, f"tgt{m}", f"targets/{m}", tokens)
          name = self._node(s, f"FB{s}.{m}", "FB", state, x, y, grads, stats)
          grads, stats = (name, 0), (name, 1)
      grads_ref[s] = grads

    # The shared embedding: each end sends its half of the gradient to the other.
    ends = (0, last)
    for s in ends:
      self._node(s, f"emb{s}", "emb", grads_ref[s])
    for s in range(num_stages):
      args = [grads_ref[s]]
      if s in ends:
        other = last if s == 0 else 0
        args.append(self._move(s, f"emb{other}to{s}", (f"emb{other}", 0), ("vocab", "embed")))
      self._node(s, f"finish{s}", "finish", *args)

    # Every stage clips by the same global norm and normalises by the same token count.
    for s in range(num_stages):
      sumsqs = [
        (f"finish{t}", 1) if t == s else self._move(s, f"sq{t}to{s}", (f"finish{t}", 1), ())
        for t in range(num_stages)
      ]
      st = stats if s == last else self._move(s, f"stats_to{s}", stats, ())
      self._node(s, f"apply{s}", "apply", f"state/{s}", (f"finish{s}", 0), st, *sumsqs)
    return Program(
      nodes=self._interleave(),
      outputs={
        **{f"state/{s}": (f"apply{s}", 0) for s in range(num_stages)},
        "metrics": (f"apply{last}", 1),
      },
      carried=tuple(f"state/{s}" for s in range(num_stages)),
    )

  def _interleave(self) -> tuple:
    """One dispatch order that keeps each island's order and puts producers before consumers."""
    queues = [list(q) for q in self.per_island]
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
