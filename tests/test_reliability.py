"""Faults: non-finite steps and rollback, damaged checkpoints, kill -9 mid-save, determinism."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, metrics_rows, tiny_test_config

from pwtrain import guard, train
from pwtrain.checkpoint import Checkpointer, integrity


def small_config(**overrides):
  """helpers' small run, checkpointed every 2 steps, rolled back after 2 non-finite ones."""
  return helpers.small_config(
    **{"train.checkpoint_every": 2, "train.rollback_after": 2, **overrides}
  )


class Batches:
  """The real data iterator, with batch `i` (0-based) replaced by `plan(i)`:
  "poison" puts an out-of-vocabulary token in it (the embedding lookup then yields NaN, as a
  corrupted record would), "drop" skips the underlying batch."""

  def __init__(self, inner, vocab_size, poison=(), drop=()):
    self.inner, self.vocab_size = inner, vocab_size
    self.poison, self.drop = set(poison), set(drop)
    self.i = 0

  def __iter__(self):
    return self

  def __next__(self):
    while self.i in self.drop:
      next(self.inner)
      self.i += 1
    batch = next(self.inner)
    if self.i in self.poison:
      batch = {**batch, "inputs": batch["inputs"].copy()}
      batch["inputs"][0, 0] = self.vocab_size
    self.i += 1
    return batch

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


def patch_batches(monkeypatch, **plan):
  real = train._train_batches

  def build(config, tokenizer, source, harness):
    return Batches(real(config, tokenizer, source, harness), config.model.vocab_size, **plan)

  monkeypatch.setattr(train, "_train_batches", build)


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_rolled_back_past(monkeypatch, tmp_path):
  """Batches 5 and 6 (steps 6 and 7) are bad. Both steps are skipped; at the next log (step 8)
  two consecutive skips trigger a rollback to the checkpoint of step 4 (the one of step 6 is set
  aside), and training goes on with batch 8. The result equals a clean run that never saw
  batches 4..7."""
  patch_batches(monkeypatch, poison={5, 6})
  result = train.run(small_config(), str(tmp_path / "spiky"), show_progress=False)
  steps = [(r["step"], r["skipped"]) for r in metrics_rows(tmp_path / "spiky") if "skipped" in r]
  # One row per step of the trajectory kept; the abandoned steps 5-8 are set aside, not lost.
  assert [s for s, _ in steps] == [*range(1, 13)]
  with open(tmp_path / "spiky" / "metrics.rolled_back.jsonl") as f:
    abandoned = [json.loads(line) for line in f]
  assert [(r["step"], r["skipped"]) for r in abandoned if "skipped" in r] == [
    (5, 0.0),
    (6, 1.0),
    (7, 1.0),
    (8, 0.0),
  ]
  assert [r for r in metrics_rows(tmp_path / "spiky") if "rollback_from" in r] == [
    {"step": 4, "rollback_from": 8, "first_bad_step": 6, "batches_skipped": 4}
  ]
  assert os.listdir(tmp_path / "spiky" / "checkpoints.rolled_back") == ["6"]
  assert result.final_step == 12

  patch_batches(monkeypatch, drop={4, 5, 6, 7})
  clean = train.run(small_config(), str(tmp_path / "clean"), show_progress=False)
  assert not any(r["skipped"] for r in clean.history)
  same = jax.tree.map(
    lambda a, b: bool(np.array_equal(a, b)), result.state["params"], clean.state["params"]
  )
  assert all(jax.tree.leaves(same))
  # After the rollback (history rows 9..) the run is the clean run's steps 5..12.
  assert [r["loss"] for r in result.history[8:]] == [r["loss"] for r in clean.history[4:]]


@pytest.mark.slow
def test_a_run_that_keeps_diverging_stops_with_checkpoints_intact(monkeypatch, tmp_path):
  patch_batches(monkeypatch, poison=set(range(5, 100)))
  with pytest.raises(guard.Diverged, match="train.max_rollbacks=1"):
    train.run(small_config(**{"train.max_rollbacks": 1}), str(tmp_path), show_progress=False)
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=3, every=2)
  assert ckpt.latest_step() == 4
  restored = _restore_any(ckpt, 4)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored["params"]))
  ckpt.close()


def _restore_any(ckpt, step):
  meta = ckpt._manager.item_metadata(step)["state"]
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  return ckpt.restore(step, abstract)[0]


def test_spike_monitor_counts_consecutive_skips_across_logs():
  monitor = guard.SpikeMonitor(rollback_after=3, max_rollbacks=5)
  history = [{"step": s, "skipped": float(s in (2, 3, 5, 6))} for s in range(1, 7)]
  assert monitor.observe(history[:4]) is None  # 2, 3 skipped: streak of 2
  assert monitor.observe(history) is None  # 4 was fine; 5, 6 a new streak of 2
  history.append({"step": 7, "skipped": 1.0})
  assert monitor.observe(history) == 5
  assert guard.SpikeMonitor(0, 5).observe(history) is None  # rollback_after=0: never


# --- damaged checkpoints -------------------------------------------------------------------


def _state(value):
  return {
    "params": {"w": jnp.arange(4096.0).reshape(64, 64) + value, "b": jnp.full((7,), value)},
    "step": jnp.int32(value),
  }


def _abstract():
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0)
  )


def _two_checkpoints(directory):
  ckpt = Checkpointer(directory, keep=3, every=1, async_save=False)
  ckpt.save(1, _state(1), {"pos": 1})
  ckpt.save(2, _state(2), {"pos": 2})
  ckpt.wait()
  ckpt.close()


def _largest_array_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  return max(files, key=os.path.getsize)


def _flip(path):
  data = bytearray(open(path, "rb").read())
  for i in range(len(data) // 2, len(data) // 2 + 16):
    data[i] ^= 0xFF
  open(path, "wb").write(bytes(data))


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


DAMAGE = {
  "flipped bytes": lambda d: _flip(_largest_array_file(d)),
  "truncated array file": lambda d: _truncate(_largest_array_file(d)),
  "garbage metadata": lambda d: open(os.path.join(d, "state", "_METADATA"), "w").write("{x"),
  "garbage data state": lambda d: open(os.path.join(d, "data", "metadata"), "w").write("{x"),
}


def test_a_read_only_reader_moves_and_deletes_nothing(tmp_path, caplog):
  """pwtrain.sample reads beside a running job: it skips a damaged checkpoint without moving it
  and leaves uncommitted parts of a save in progress alone."""
  directory = str(tmp_path / "checkpoints")
  _two_checkpoints(directory)
  DAMAGE["flipped bytes"](os.path.join(directory, "2"))
  pending = os.path.join(f"{directory}.pending", "3-inflight")
  os.makedirs(pending)
  reader = Checkpointer(directory, keep=3, every=1, read_only=True)
  step, _, _ = reader.restore_latest(_abstract())
  assert step == 1 and "checkpoint 2 is damaged" in caplog.text
  assert sorted(os.listdir(directory)) == ["1", "2"] and os.path.isdir(pending)
  with pytest.raises(RuntimeError, match="read-only"):
    reader.save(3, _state(3), {"pos": 3})
  reader.close()


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_checkpoint_is_reported_set_aside_and_the_previous_used(
  damage, tmp_path, caplog
):
  directory = str(tmp_path / "checkpoints")
  _two_checkpoints(directory)
  DAMAGE[damage](os.path.join(directory, "2"))
  ckpt = Checkpointer(directory, keep=3, every=1)
  step, state, data = ckpt.restore_latest(_abstract())
  assert (step, data) == (1, {"pos": 1})
  assert all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(1)), strict=True)
  )
  assert "checkpoint 2 is damaged" in caplog.text
  (line,) = [r.getMessage() for r in caplog.records if "checkpoint 2 is damaged" in r.getMessage()]
  assert "\n" not in line and len(line) < 400, line  # one line, not the library's pages
  assert ckpt.all_steps() == [1] and os.listdir(directory + ".corrupt") == ["2"]
  ckpt.save(2, _state(2), {"pos": 2})  # the step can be written again
  ckpt.wait()
  assert ckpt.restore_latest(_abstract())[0] == 2
  ckpt.close()


@pytest.mark.processes
def test_a_damaged_checkpoint_prints_one_line_not_tracebacks(tmp_path):
  """In a process of its own (pytest would catch what it prints): the reads Orbax abandons when
  one array file is truncated must not print their tracebacks ("Event loop is closed")."""
  script = f"""
import logging, os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import test_reliability as t
from pwtrain.checkpoint import Checkpointer
logging.basicConfig(level=logging.WARNING)
directory = {str(tmp_path / "checkpoints")!r}
t._two_checkpoints(directory)
t.DAMAGE["truncated array file"](os.path.join(directory, "2"))
ckpt = Checkpointer(directory, keep=3, every=1)
print("restored step", ckpt.restore_latest(t._abstract())[0])
ckpt.close()
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and "restored step 1" in out.stdout, out.stderr[-2000:]
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "checkpoint 2 is damaged" in lines[0], out.stderr[-3000:]


@pytest.mark.parametrize(
  "error",
  [
    TypeError("'NoneType' object is not subscriptable"),
    KeyError("params/w"),
    IndexError("list index out of range"),
    ValueError("not enough values to unpack (expected 3, got 2)"),
    RuntimeError("dictionary changed size during iteration"),
    jax.errors.JaxRuntimeError("no memory"),
  ],
  ids=lambda e: type(e).__name__,
)
def test_an_error_of_reading_code_is_raised_and_the_checkpoint_kept(error, tmp_path):
  """A bug in reading code (ours or a library's) or a device's error says nothing about the
  files: it is raised as it is, and the good checkpoint is neither set aside nor skipped (such
  a bug once moved a good checkpoint to checkpoints.corrupt and training began again)."""
  directory = str(tmp_path / "checkpoints")
  _two_checkpoints(directory)
  ckpt = Checkpointer(directory, keep=3, every=1)

  def failing_restore(*args, **kwargs):
    raise error

  ckpt._manager.restore = failing_restore
  with pytest.raises(type(error), match=re.escape(str(error))):
    ckpt.restore_latest(_abstract())
  assert ckpt.all_steps() == [1, 2] and not os.path.exists(directory + ".corrupt")
  ckpt.close()


def test_checkpoint_of_another_model_is_an_error_not_a_fallback(tmp_path):
  directory = str(tmp_path / "checkpoints")
  _two_checkpoints(directory)
  other = {**_abstract(), "params": {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}}
  ckpt = Checkpointer(directory, keep=3, every=1)
  with pytest.raises(integrity.IncompatibleCheckpoint, match="step 2"):
    ckpt.restore_latest(other)
  assert ckpt.all_steps() == [1, 2]  # nothing moved
  ckpt.close()


def test_fingerprint_ignores_sharding_and_sees_any_change():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  x = jnp.arange(64.0).reshape(8, 8)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
  assert integrity.fingerprint({"x": x}) == integrity.fingerprint({"x": sharded})
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
  assert integrity.fingerprint({"x": swapped}) != integrity.fingerprint({"x": x})
  one_ulp = x.at[3, 3].set(jnp.nextafter(x[3, 3], jnp.inf))
  assert integrity.fingerprint({"x": one_ulp}) != integrity.fingerprint({"x": x})


@pytest.mark.slow
def test_trainer_resumes_from_the_checkpoint_before_a_damaged_one(tmp_path, caplog):
  """Train 8 steps (checkpoints 4, 8), damage step 8, rerun to 12: resumes from 4 and steps
  5..12 repeat the straight run's losses exactly."""
  cfg = dict(**{"train.checkpoint_every": 4})
  straight = train.run(small_config(**cfg), str(tmp_path / "straight"), show_progress=False)
  workdir = tmp_path / "damaged"
  train.run(small_config(**cfg, **{"train.num_steps": 8}), str(workdir), show_progress=False)
  _flip(_largest_array_file(str(workdir / "checkpoints" / "8")))
  resumed = train.run(small_config(**cfg), str(workdir), show_progress=False)
  assert "checkpoint 8 is damaged" in caplog.text
  assert resumed.start_step == 4
  assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history[4:]]
  # Steps 5..8, trained and logged by the first start, ran again: their time is badput.
  rows = metrics_rows(workdir)
  intervals = [r for r in rows if "goodput" in r]
  assert [r["step"] for r in intervals] == [2, 4, 6, 8, 10, 12]
  assert [r["badput_rerun"] > 0 for r in intervals] == [False, False, True, True, True, True]


# --- kill -9 in the middle of an asynchronous save -----------------------------------------

CHILD = textwrap.dedent(
  """
  import os, signal, sys
  import jax.numpy as jnp
  from pwtrain.checkpoint import Checkpointer
  ckpt = Checkpointer(sys.argv[1], keep=3, every=1, async_save=True)
  ckpt.save(1, {"w": jnp.ones((256, 1024))}, {"pos": 1})
  ckpt.wait()
  big = {"w": jnp.full((4096, 8192), 2.0)}  # 128 MiB: the write outlives the kill
  ckpt.save(2, big, {"pos": 2})
  print("in flight:", sorted(os.listdir(sys.argv[1])), flush=True)
  os.kill(os.getpid(), signal.SIGKILL)
  """
)


@pytest.mark.processes
def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
  directory = str(tmp_path / "checkpoints")
  proc = subprocess.run(
    [sys.executable, "-c", CHILD, directory], cwd=REPO, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert proc.returncode == -9, proc.stderr[-2000:]
  in_flight = proc.stdout.split("in flight:")[1]
  assert "tmp" in in_flight, f"the save had already committed: {in_flight}"
  ckpt = Checkpointer(directory, keep=3, every=1)
  abstract = {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}
  step, state, data = ckpt.restore_latest(abstract)
  assert (step, data) == (1, {"pos": 1}) and np.all(np.asarray(state["w"]) == 1.0)
  ckpt.close()


# --- determinism ---------------------------------------------------------------------------


def test_same_config_and_seed_give_the_same_losses(tmp_path):
  cfg = small_config(**{"train.num_steps": 6, "train.checkpoint_every": 100})
  a = train.run(cfg, str(tmp_path / "a"), show_progress=False)
  b = train.run(cfg, str(tmp_path / "b"), show_progress=False)
  assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
  shutil.rmtree(tmp_path / "b")


def test_unwritable_workdir_is_a_clear_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="--workdir=.* cannot be created"):
    train.run(small_config(), str(blocker / "run"), show_progress=False)


# --- every stage and pod skips together ----------------------------------------------------

SKIP_LAYOUTS = {
  "one_island": {},
  "2pods_x_2stages": {
    "model.num_layers": 4,
    "parallel.islands": 4,
    "parallel.stages": 2,
    "parallel.pods": 2,
    "train.num_microbatches": 2,
  },
}


@pytest.mark.parametrize("layout", sorted(SKIP_LAYOUTS))
@pytest.mark.slow
def test_a_nonfinite_step_changes_no_stage_or_pod(layout):
  """Only pod 0's half of the batch is bad, yet every cell keeps its parameters and optimizer
  state (all decide from the same global loss), and the next clean step trains again."""
  from helpers import random_batches

  from pwtrain.harness import Harness

  config = tiny_test_config(**SKIP_LAYOUTS[layout])
  bad, good = random_batches(config, 2)
  bad["inputs"][0, 0] = config.model.vocab_size
  with Harness.build(config) as harness:
    program, state = harness.step_program, harness.init()
    host = [jax.device_get(state)]
    skipped = []
    for i, batch in enumerate((bad, good)):
      out = harness.step(state, batch, i)
      state = {k: v.result() for k, v in out.state.items()}
      skipped.append(float(out.metrics.result()["skipped"]))
      host.append(jax.device_get(state))
  assert skipped == [1.0, 0.0]
  for key in program.state_keys:  # one per cell (pod, stage); "state" for one island
    for part in ("params", "opt_state"):
      same = jax.tree.map(np.array_equal, host[0][key][part], host[1][key][part])
      assert all(jax.tree.leaves(same)), f"{key} {part} changed on a skipped step"
  first = program.to_checkpoint(host[1])["params"]
  second = program.to_checkpoint(host[2])["params"]
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, first, second)))
