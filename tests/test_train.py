"""End to end: `main` trains, logs and checkpoints; an interrupted run resumes exactly."""

import glob
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import REPO, TINY, metrics_rows, small_config, step_losses

from pwtrain import train

SMALL = [
  "--config.model.num_layers=2",
  "--config.model.d_model=64",
  "--config.model.head_dim=8",
  "--config.model.d_ff=128",
  "--config.data.seq_len=32",
  "--config.data.max_files=40",
  "--config.train.log_every=2",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  result = train.run(
    small_config(**{"train.checkpoint_every": 4}), str(workdir), show_progress=False
  )
  return workdir, result


def test_run_writes_metrics_tensorboard_and_checkpoints(uninterrupted):
  workdir, result = uninterrupted
  assert result.final_step == 12 and len(result.history) == 12
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints")) == [4, 8, 12]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tensorboard"))
  rows = metrics_rows(workdir)
  assert any("tokens_per_s" in r for r in rows)
  losses = [r["loss"] for r in result.history]
  assert np.all(np.isfinite(losses))


@pytest.mark.slow
def test_resume_continues_exactly(uninterrupted, tmp_path):
  """Stop after 6 steps (checkpoint at 4 and 6), rerun: steps 7..12 equal the straight run."""
  ref_dir, ref = uninterrupted
  first = train.run(
    small_config(**{"train.checkpoint_every": 4, "train.num_steps": 6}),
    str(tmp_path),
    show_progress=False,
  )
  assert first.final_step == 6
  second = train.run(
    small_config(**{"train.checkpoint_every": 4}), str(tmp_path), show_progress=False
  )
  assert second.start_step == 6 and second.final_step == 12
  # It resumed from the last step the first start trained: nothing ran twice.
  rows = metrics_rows(tmp_path)
  assert all(r["badput_rerun"] == 0 for r in rows if "goodput" in r)
  ref_losses = [r["loss"] for r in ref.history]
  got = [r["loss"] for r in first.history] + [r["loss"] for r in second.history]
  np.testing.assert_array_equal(got, ref_losses)  # bitwise on CPU
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(second.state), jax.device_get(ref.state)
  )


@pytest.mark.slow
def test_resume_onto_a_different_mesh(uninterrupted, tmp_path):
  """A checkpoint saved data-parallel restores onto a tensor/fsdp mesh and continues."""
  _, ref = uninterrupted
  train.run(
    small_config(**{"train.checkpoint_every": 6, "train.num_steps": 6}),
    str(tmp_path),
    show_progress=False,
  )
  other = small_config(**{"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2})
  result = train.run(other, str(tmp_path), show_progress=False)
  assert result.start_step == 6
  # Same math on another layout: equal up to reduction order (see test_parity for tolerances).
  np.testing.assert_allclose(
    [r["loss"] for r in result.history], [r["loss"] for r in ref.history[6:]], rtol=1e-4
  )


def test_resume_false_refuses_to_overwrite(uninterrupted):
  workdir, _ = uninterrupted
  before = sorted(os.listdir(workdir / "checkpoints"))
  with pytest.raises(ValueError, match="train.resume=False"):
    train.run(small_config(**{"train.resume": False}), str(workdir), show_progress=False)
  assert sorted(os.listdir(workdir / "checkpoints")) == before


@pytest.mark.slow
def test_incompatible_checkpoint_is_a_clear_error(uninterrupted, tmp_path):
  workdir, _ = uninterrupted
  with pytest.raises(ValueError, match="does not match this config"):
    train.run(small_config(**{"model.d_ff": 256}), str(workdir), show_progress=False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
@pytest.mark.slow
@pytest.mark.processes
def test_main_interrupted_resumes(sig, uninterrupted, tmp_path):
  """The README's command, interrupted (Ctrl-C, or SIGTERM as a preempting scheduler sends) and
  run again: it checkpoints at the next step boundary, exits cleanly, and the rerun's losses
  match the straight run."""
  ref_dir, _ = uninterrupted
  cmd = [
    sys.executable, "-m", "pwtrain.main", "--config=configs/palm_tiny.py",
    f"--workdir={tmp_path}", *SMALL, "--config.train.num_steps=12",
    "--config.train.checkpoint_every=4", "--config.backend.max_inflight_steps=0",
  ]  # fmt: skip
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 180
  while time.time() < deadline and proc.poll() is None:
    if any(s >= 2 for s in step_losses(tmp_path, running=True)):
      break
    time.sleep(0.05)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-2000:]
  stopped = max(step_losses(tmp_path))
  assert stopped < 12, "the run finished before it could be interrupted"
  assert stopped in {int(d) for d in os.listdir(tmp_path / "checkpoints")}

  rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert step_losses(tmp_path) == step_losses(ref_dir)


def read_tensorboard(directory) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of every scalar in the event files under `directory` (TFRecord
  framing: length, its CRC, the Event proto, its CRC)."""
  import struct

  from tensorboardX.proto import event_pb2

  scalars: dict[str, dict[int, float]] = {}
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    at = 0
    while at + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return scalars


def test_evaluation_is_logged_to_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
  """eval_every=4 over 6 steps: evaluations after steps 4 and 6 (the last), in metrics.jsonl
  after their step's rows, in TensorBoard under eval/, and in a W&B run (offline, local)."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = small_config(
    **{
      "train.num_steps": 6,
      "train.eval_every": 4,
      "train.eval_batches": 2,
      "metrics.wandb_project": "pwtrain-test",
    }
  )
  result = train.run(config, str(tmp_path), show_progress=False)
  assert [e["step"] for e in result.evals] == [4, 6]
  for e in result.evals:
    assert 0 < e["eval_loss"] < 7 and np.isclose(e["eval_perplexity"], np.exp(e["eval_loss"]))
    assert e["eval_tokens"] == 2 * 16 * 32  # every position of the eval windows is a target
    # Bytes: one per target, but EOS stands for none, so bits/byte >= loss in bits per token.
    bits = e["eval_loss"] / np.log(2)
    assert bits <= e["eval_bits_per_byte"] < 1.1 * bits
  assert result.evals[1]["eval_loss"] < result.evals[0]["eval_loss"] + 0.5

  rows = metrics_rows(tmp_path)
  evals = [r for r in rows if "eval_loss" in r]
  assert evals == result.evals
  first_eval = rows.index(evals[0])
  assert [r["step"] for r in rows[:first_eval] if "loss" in r] == [1, 2, 3, 4]

  scalars = read_tensorboard(tmp_path / "tensorboard")
  assert scalars["eval/loss"] == pytest.approx({e["step"]: e["eval_loss"] for e in result.evals})
  assert set(scalars["train/loss"]) == set(range(1, 7))

  (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
  logged = open(run_file, "rb").read()
  for key in (b"eval/loss", b"eval/bits_per_byte", b"train/loss", b"perf/tokens_per_s"):
    assert key in logged, key


@pytest.mark.processes
def test_pathways_without_pathwaysutils_is_one_clear_line(tmp_path):
  """JAX_PLATFORMS=proxy asks for Pathways on Cloud: without pathwaysutils, say what to install
  before JAX starts (not JAX's own error about an unknown platform)."""
  env = {**os.environ, "JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "grpc://127.0.0.1:1"}
  cmd = [sys.executable, "-m", "pwtrain.main", "--config=configs/palm_tiny.py"]
  out = subprocess.run(
    [*cmd, f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == (
    "JAX_PLATFORMS=proxy (Pathways on Cloud) needs pathwaysutils, which is not installed: "
    "pip install 'pwtrain[pathways]'"
  )
  assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.slow
@pytest.mark.processes
def test_a_restart_loads_its_programs_from_the_workdirs_compile_cache(tmp_path):
  """train.compile_cache_dir="": JAX's persistent cache under the workdir; a second start of the
  run (a restart) finds every program there and compiles nothing new."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  flags = [f"--config.{k}={v}" for k, v in {**TINY, "train.log_every": 1}.items()]

  def start(num_steps):
    out = subprocess.run(
      [sys.executable, "-m", "pwtrain.main", "--config=configs/palm_tiny.py",
       f"--workdir={tmp_path}", *flags, f"--config.train.num_steps={num_steps}",
       "--config.data.max_files=40", "--config.train.eval_every=0"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return sorted(os.listdir(tmp_path / "compile_cache"))

  first = start(2)
  assert len(first) >= 3  # init, the step, the checkpoint's fingerprints at least
  assert start(4) == first  # resumed from step 2: nothing compiled again
