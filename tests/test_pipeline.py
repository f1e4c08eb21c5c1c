"""Pipeline stages on separate islands: parity with one device, schedules, dispatch, memory."""

import shutil
import time

import jax
import numpy as np
import pytest
from helpers import (
  SGD,
  assert_close,
  assert_trees_close,
  random_batches,
  run_steps,
  small_config,
  tiny_test_config,
)

from pwtrain.backend import Trace
from pwtrain.harness import Harness
from pwtrain.models import arithmetic
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel.pipeline import island_order, makespan, peak_live_inputs
from pwtrain.parallel.pipeline.schedule import island_orders
from pwtrain.parallel.stages import Stage, balanced_boundaries, make_stages

NUM_STEPS = 2


def pipe(stages, schedule, micro, **more):
  return {
    "model.num_layers": 4,
    "parallel.islands": stages,
    "parallel.stages": stages,
    "parallel.schedule": schedule,
    "train.num_microbatches": micro,
    **more,
  }


@pytest.fixture(scope="module")
def reference():
  config = tiny_test_config(**SGD, **{"model.num_layers": 4})
  batches = random_batches(config, NUM_STEPS)
  one = jax.devices()[:1]
  adafactor = run_steps(tiny_test_config(**{"model.num_layers": 4}), batches, one)
  return batches, run_steps(config, batches, one), adafactor


LAYOUTS = {
  "2stages_gpipe_m1": pipe(2, "gpipe", 1),
  "2stages_1f1b_m4_tp2": pipe(2, "1f1b", 4, **{"parallel.data": 2, "parallel.tensor": 2}),
  "4stages_gpipe_m4": pipe(4, "gpipe", 4),
  "4stages_1f1b_m8_1dev": pipe(4, "1f1b", 8, **{"parallel.data": 1}),
  # Stages that keep their forward's residuals for the backward instead of recomputing it.
  "2stages_1f1b_m4_tp2_keep": pipe(
    2, "1f1b", 4, **{"parallel.data": 2, "parallel.tensor": 2, "parallel.stage_remat": "none"}
  ),
  "4stages_gpipe_m4_keep": pipe(4, "gpipe", 4, **{"parallel.stage_remat": "none"}),
  # The backward split into B (input gradient) and W (parameter gradient): recomputed, and
  # from the residuals of F (FB's own on the last stage) on the two middle stages.
  "2stages_zb_m4_tp2": pipe(2, "zero_bubble", 4, **{"parallel.data": 2, "parallel.tensor": 2}),
  "4stages_zb_m4_keep": pipe(4, "zero_bubble", 4, **{"parallel.stage_remat": "none"}),
  # Interleaved: 4 one-layer chunks, chunks 0 and 2 on island 0, 1 and 3 on island 1.
  "2stages_interleaved_v2_m4": pipe(2, "interleaved", 4, **{"parallel.virtual_stages": 2}),
  "2stages_interleaved_v2_m2_keep": pipe(
    2, "interleaved", 2, **{"parallel.virtual_stages": 2, "parallel.stage_remat": "none"}
  ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_pipeline_matches_single_device(reference, layout):
  batches, (ref_metrics, ref_state), _ = reference
  overrides = dict(LAYOUTS[layout])
  if layout.endswith("1dev"):
    overrides["parallel.devices_per_island"] = 1  # 4 one-device islands
  metrics, state = run_steps(tiny_test_config(**SGD, **overrides), batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    keys = ("loss", "ce_loss", "z_loss", "grad_norm", "param_norm", "update_norm", "tokens", "lr")
    for key in keys:
      assert_close(got[key], want[key], key)
  assert_trees_close(state["params"], ref_state["params"], "params")
  assert_trees_close(state["opt_state"], ref_state["opt_state"], "opt_state")


@pytest.mark.slow
def test_pipeline_with_adafactor_matches_single_device(reference):
  batches, _, (ref_metrics, _) = reference
  metrics, _ = run_steps(tiny_test_config(**pipe(2, "1f1b", 2)), batches)
  for got, want in zip(metrics, ref_metrics, strict=True):
    for key in ("loss", "grad_norm"):
      assert_close(got[key], want[key], key)


def test_schedules():
  stages = [Stage(s, s, s + 1, s == 0, s == 3) for s in range(4)]
  gpipe = [island_order("gpipe", st, 4, 8) for st in stages]
  one_f = [island_order("1f1b", st, 4, 8) for st in stages]
  assert gpipe[0] == [("F", m) for m in range(8)] + [("B", m) for m in range(8)]
  assert one_f[1][:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
  assert one_f[3] == gpipe[3] == [("FB", m) for m in range(8)]
  for order in gpipe + one_f:  # every microbatch goes forward then backward exactly once
    assert sorted(order) == sorted(set(order))
  # 1F1B holds at most S - s microbatches' inputs; GPipe holds all M.
  assert [peak_live_inputs(o) for o in gpipe[:3]] == [8, 8, 8]
  assert [peak_live_inputs(o) for o in one_f[:3]] == [4, 3, 2]
  # zero_bubble: 1F1B's order with W (the parameters' gradient) of the previous microbatch
  # after each B on every stage but the first, which keeps its whole B; one more microbatch
  # held until its W.
  zb = [island_order("zero_bubble", st, 4, 8) for st in stages]
  assert zb[0] == one_f[0]
  assert zb[3][:4] == [("FB", 0), ("FB", 1), ("W", 0), ("FB", 2)] and zb[3][-1] == ("W", 7)
  assert [k for k, _ in zb[1] if k != "W"] == [k for k, _ in one_f[1]]
  for order in zb[1:]:
    assert sorted(m for k, m in order if k == "W") == list(range(8))
    for kind, m in order:  # W after its microbatch's B
      if kind == "W":
        assert order.index(("B" if ("B", m) in order else "FB", m)) < order.index(("W", m))
  assert [peak_live_inputs(o) for o in zb] == [4, 4, 3, 2]
  # Counted from the schedules (F, B, W = 1, 2, 1): 1F1B's step is (M + S - 1) (F + B); the
  # split backward shortens it (a count, not a measurement: bench_distributed measures).
  cost = {"F": 1.0, "B": 2.0, "W": 1.0, "FB": 3.0}
  assert makespan("1f1b", stages, 8, cost) == makespan("gpipe", stages, 8, cost) == 11 * 3
  assert makespan("zero_bubble", stages, 8, cost) == 29
  two = [Stage(0, 0, 1, True, False), Stage(1, 1, 2, False, True)]
  assert (makespan("1f1b", two, 4, cost), makespan("zero_bubble", two, 4, cost)) == (15, 13)
  # Interleaved, 2 islands x 2 chunks: island i runs chunks i and i + 2, each chunk every
  # microbatch's forward and backward once (the last chunk's FB), in groups of S = 2; the
  # bubble halves (a chunk's pieces take half a stage's).
  chunks = [Stage(c, c, c + 1, c == 0, c == 3) for c in range(4)]
  orders = island_orders("interleaved", chunks, 4, virtual=2)
  assert orders[0][:5] == [(0, "F", 0), (0, "F", 1), (2, "F", 0), (2, "F", 1), (0, "F", 2)]
  for i, order in enumerate(orders):
    assert {c for c, _, _ in order} == {i, i + 2}
    kinds = {"F", "B"} if i == 0 else {"F", "B", "FB"}
    assert (
      sorted(order) == sorted({(c, k, m) for c, k, m in order})
      and {k for _, k, _ in order} == kinds
    )
  assert [island_order("interleaved", st, 4, 4, virtual=2) for st in chunks][3] == [
    ("FB", m) for m in range(4)
  ]
  assert makespan("interleaved", chunks, 4, cost, virtual=2) == 13.5  # 1F1B: 15


def test_balanced_boundaries():
  assert balanced_boundaries([1.0] * 8, 4) == [0, 2, 4, 6, 8]
  # A heavy output layer on the last stage pushes layers toward the first stages.
  assert balanced_boundaries([1.0] * 8, 2, last_extra=4.0) == [0, 6, 8]
  assert balanced_boundaries([1.0, 5.0, 1.0, 1.0], 2) == [0, 2, 4]
  config = tiny_test_config(**pipe(2, "1f1b", 2, **{"parallel.stage_boundaries": (0, 3, 4)}))
  assert [(s.start, s.stop) for s in make_stages(config)] == [(0, 3), (3, 4)]


@pytest.mark.parametrize(
  "overrides,message",
  [
    (pipe(2, "1f1b", 2, **{"parallel.stage_boundaries": (0, 4, 4)}), "parallel.stage_boundaries="),
    (
      pipe(2, "1f1b", 2, **{"parallel.islands": 4}),
      "parallel.islands=4 must equal parallel.pods * parallel.stages = 1 * 2 = 2",
    ),
    (pipe(8, "1f1b", 2, **{"model.num_layers": 4}), "parallel.stages=8 exceeds model.num_layers=4"),
    (pipe(2, "zigzag", 2), "parallel.schedule='zigzag' is not a schedule"),
    (
      pipe(2, "1f1b", 2, **{"parallel.stage_remat": "dots"}),
      "parallel.stage_remat='dots' is not supported; valid: full, none",
    ),
    (
      pipe(2, "1f1b", 2, **{"parallel.stage_remat": "none", "backend.mode": "remote"})
      | {"backend.launch_workers": True},
      "parallel.stage_remat='none' is not supported with backend.mode='remote'",
    ),
    (pipe(2, "1f1b", 16), "train.global_batch=16 must be divisible by"),
  ],
)
def test_bad_pipeline_configs(overrides, message):
  import re

  from pwtrain import config as config_lib

  config = tiny_test_config(**overrides)
  with pytest.raises(ValueError, match=re.escape(message)):
    config_lib.validate(config)
    plan_lib.build(config, plan_lib.make_cluster(config))


@pytest.mark.slow
def test_whole_step_is_dispatched_before_it_runs():
  """Parallel asynchronous dispatch: the step returns before its metrics are computed, every node
  of the 4-stage step is enqueued before the last stage finishes anything, and the trace shows
  the islands working on the step concurrently."""
  wide = {"model.d_model": 256, "model.d_ff": 1024, "backend.max_inflight_steps": 4}
  config = tiny_test_config(**pipe(4, "1f1b", 4, **wide))
  trace = Trace()
  batch = random_batches(config, 1)[0]
  with Harness.build(config, trace=trace) as harness:
    program = harness.step_program
    out = harness.step(harness.init(), batch, 0)  # warm up
    jax.block_until_ready(out.metrics.result())
    t0 = time.perf_counter()
    out = harness.step(out.state, batch, 1)
    dispatch = time.perf_counter() - t0
    metrics = out.metrics
    pending = not metrics.done() or any(not m.is_ready() for m in jax.tree.leaves(metrics.result()))
    jax.block_until_ready(out.metrics.result())
    total = time.perf_counter() - t0
  assert pending, (dispatch, total)
  step1 = [e for e in trace.events if e.step == 2]
  assert len(step1) == len(program.program.nodes)
  assert {e.island for e in step1} == {f"island{i}" for i in range(4)}
  last_dispatch = max(e.dispatch for e in step1)
  first_done = min(e.done for e in step1 if ":FB" in e.name)
  assert last_dispatch < first_done  # all enqueued before the last stage finished anything


@pytest.mark.slow
def test_activation_memory_1f1b_below_gpipe():
  """Live-buffer accounting: the bytes of saved stage inputs held at the peak of each schedule,
  from the compiled forward's input size."""
  config = tiny_test_config(
    **pipe(4, "1f1b", 8, **{"parallel.data": 1, "parallel.devices_per_island": 1})
  )
  with Harness.build(config) as harness:
    program = harness.step_program
    out_bytes = program.executables[("F", 0, 1)].memory_analysis().output_size_in_bytes
  assert out_bytes == 2 * 32 * 64 * 4  # one microbatch's activation [2, 32, 64] fp32
  stages = program.stages
  for stage in stages[:-1]:
    gpipe = peak_live_inputs(island_order("gpipe", stage, 4, 8)) * out_bytes
    one_f = peak_live_inputs(island_order("1f1b", stage, 4, 8)) * out_bytes
    assert one_f < gpipe
    print(f"stage {stage.index}: GPipe {gpipe} B, 1F1B {one_f} B")


@pytest.mark.parametrize("remat", ["dots", "none_scanned", "none"])
@pytest.mark.slow
def test_stage_remat_none_keeps_residuals_instead_of_recomputing(remat):
  """parallel.stage_remat="none": F returns its stage's VJP residuals, as many bytes per token
  as the dry run counts for the stage's blocks under model.remat (estimate.activation_bytes;
  unrolled at "none" more: the jaxpr's whole set, where the dry run counts what survives XLA's
  fusion and says it is a lower bound), and B no longer runs the stage's forward again (the
  compiled pieces' FLOPs)."""
  overrides = pipe(2, "1f1b", 2, **{"parallel.data": 1, "parallel.devices_per_island": 1})
  overrides |= {"model.remat": remat.removesuffix("_scanned")}
  overrides["model.scan_layers"] = remat.endswith("_scanned")
  pieces = {}
  for stage_remat in ("full", "none"):
    config = tiny_test_config(**overrides, **{"parallel.stage_remat": stage_remat})
    with Harness.build(config) as harness:
      program = harness.step_program
      pieces[stage_remat] = {k: program.executables[(k, 0, 0)].compiled for k in ("F", "B")}
  stage = program.stages[0]
  tokens = 16 // 2 * 32  # a microbatch: 8 of the 16 rows of 32 tokens
  act_bytes = tokens * 64 * 4  # the output activation: [8, 32, 64] fp32
  assert pieces["full"]["F"].memory_analysis().output_size_in_bytes == act_bytes
  saved = pieces["none"]["F"].memory_analysis().output_size_in_bytes - act_bytes
  kept = stage.num_layers * arithmetic.remat_kept_bytes(config.model, 1, 32, config.model.remat)
  if remat == "none":  # 1.80x measured; a copy of the stage's parameters would add 0.17x
    assert kept < saved / tokens < 1.9 * kept
  else:
    assert saved / tokens == pytest.approx(kept, rel=0.02)

  flops = {k: {p: c.cost_analysis()["flops"] for p, c in v.items()} for k, v in pieces.items()}
  forward = flops["full"]["F"]
  assert flops["none"]["F"] == pytest.approx(forward, rel=0.05)
  assert flops["full"]["B"] - flops["none"]["B"] > 0.7 * forward  # the forward, not run again


def run(workdir, **overrides):
  from pwtrain import train

  return train.run(small_config(**overrides), str(workdir), show_progress=False)


PIPE2 = pipe(2, "1f1b", 2, **{"model.num_layers": 2, "train.checkpoint_every": 3})


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_exactly_and_across_topologies(tmp_path):
  straight = run(tmp_path / "straight", **PIPE2)
  losses = [r["loss"] for r in straight.history]
  assert straight.final_step == 12

  # Pipeline -> stop at 6 -> pipeline again: bitwise the straight pipeline run.
  first = run(tmp_path / "pp", **{**PIPE2, "train.num_steps": 6})
  # The same 6 pipeline steps start the pipeline -> single-island resume below: a copy of them.
  shutil.copytree(tmp_path / "pp", tmp_path / "pp_to_spmd")
  second = run(tmp_path / "pp", **PIPE2)
  assert second.start_step == 6
  np.testing.assert_array_equal([r["loss"] for r in first.history + second.history], losses)
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(second.state), jax.device_get(straight.state)
  )

  # Pipeline checkpoint -> single-island run, and single-island checkpoint -> pipeline run.
  spmd = run(tmp_path / "pp_to_spmd", **{"train.checkpoint_every": 3})
  run(tmp_path / "spmd_to_pp", **{"train.checkpoint_every": 3, "train.num_steps": 6})
  pp = run(tmp_path / "spmd_to_pp", **PIPE2)
  for result in (spmd, pp):
    assert result.start_step == 6
    # Same math, other layout: equal up to reduction order.
    np.testing.assert_allclose([r["loss"] for r in result.history], losses[6:], rtol=1e-4)


@pytest.mark.slow
def test_a_process_outlines_the_pieces_of_islands_it_does_not_run():
  """Distributed mode compiles only this process's islands' pieces (backend/outline.py): here a
  process that runs islands 0 and 3 of 2 pods x 2 stages (2-device meshes, tensor=2) traces
  islands 1 and 2's pieces to Outlines, and they answer what their compiles answer: output
  shapes, dtypes and shardings, and input shardings; unknown (None) only F's residuals at
  stage_remat="none" (KEPT: read by B on their island only), and B's inputs of them. A piece
  whose output sharding the compiler chooses and another island reads (the int8 encoding's
  parts) is compiled."""
  from pwtrain.backend import Controller
  from pwtrain.backend.outline import Outline

  layout = {
    "parallel.pods": 2,
    "parallel.islands": 4,
    "parallel.devices_per_island": 2,
    "parallel.tensor": 2,
    "parallel.data": 1,
    "exchange.compression": "int8",
  }
  elsewhere = {"island1", "island2"}
  none = lambda x: x is None
  for stage_remat in ("full", "none"):
    overrides = {**layout, "parallel.stage_remat": stage_remat}
    config = tiny_test_config(**pipe(2, "1f1b", 2, **overrides))
    with Harness.build(config) as whole:
      want = whole.step_program.executables
    cluster = plan_lib.make_cluster(config)
    with Controller(cluster) as controller:
      for island in elsewhere:  # as if another process held these islands' devices
        controller._dispatcher._here[island] = False
      with Harness.build(config, cluster=cluster, controller=controller) as part:
        got = part.step_program.executables
    assert set(got) == set(want)
    outlined = {k for k, exe in got.items() if isinstance(exe.compiled, Outline)}
    assert {k[0] for k, exe in got.items() if exe.island in elsewhere} - {"enc"} == {
      k[0] for k in outlined
    }
    assert all(got[k].island in elsewhere for k in outlined)
    unknown = set()
    for key in outlined:
      a, b = got[key].compiled, want[key].compiled
      for x, y in zip(jax.tree.leaves(a.out_info), jax.tree.leaves(b.out_info), strict=True):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), key
        if x.sharding is None:
          unknown.add(key[0])
        else:
          assert x.sharding == y.sharding, key
      assert jax.tree.structure(a.out_info) == jax.tree.structure(b.out_info), key
      assert got[key].num_outputs == want[key].num_outputs, key
      # None: the compile's for an argument the piece does not read (it drops it), the
      # Outline's for one whose sharding is unknown here (F's residuals, into B).
      same = jax.tree.map(
        lambda y, x: y is None or x is None or x == y,
        b.input_shardings,
        a.input_shardings,
        is_leaf=none,
      )
      assert all(jax.tree.leaves(same)), key
      if any(x is None for x in jax.tree.leaves(a.input_shardings, is_leaf=none)):
        unknown.add(f"{key[0]} input")
    assert unknown == ({"F", "B input"} if stage_remat == "none" else set())
    with pytest.raises(RuntimeError, match="another process's island"):
      got[next(iter(outlined))].memory_analysis()
