"""`--dry_run --compile` (pwtrain/dryrun/compile.py): the trainer's own step compiled for a TPU
topology on this CPU host with libtpu, and its compiled memory and FLOPs next to the dry run's
arithmetic.

Skipped only where libtpu is absent (CI installs it with the [test] extra)."""

import os
import subprocess
import sys

import ml_collections
import pytest
from helpers import REPO, tiny_test_config

pytest.importorskip("libtpu", reason="--dry_run --compile needs libtpu: pip install 'pwtrain[tpu]'")

from pwtrain.dryrun import compile as dryrun_compile  # noqa: E402

# A TPU program compiled twice finds its persistent-cache entry, which a compile-only client
# cannot load: JAX warns and compiles it again.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")

# palm_8b (scanned layers, remat "dots", 8 microbatches, fully sharded) at a width that compiles
# in seconds, on one v4 slice of 8 chips.
SMALL_8B = {
  "model.num_layers": 4,
  "model.d_model": 256,
  "model.num_heads": 4,
  "model.head_dim": 64,
  "model.d_ff": 1024,
  "model.vocab_size": 1024,
  "data.sp_vocab_size": 1024,
  "data.seq_len": 256,
  "train.global_batch": 64,
  "parallel.fsdp": 8,
  "hardware.topology": "v4:2x2x2",
}


def run_main(*flags: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-m", "pwtrain.main", *flags],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def tpu_config(topology: str, **overrides):
  c = tiny_test_config(**overrides)
  with c.unlocked():
    c.hardware = ml_collections.ConfigDict({"name": "tpu_v4", "topology": topology})
  return c


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.tpu
def test_cli_compiles_the_scanned_step_and_reports_it():
  """The command a user runs: plan, then the compiled figures; the compiled FLOPs (a step with
  two loops: the microbatches and the scanned layers) agree with the 6N + 12LHQT arithmetic."""
  flags = [f"--config.{k}={v}" for k, v in SMALL_8B.items()]
  proc = run_main("--config=configs/palm_8b.py", "--dry_run", "--compile", *flags)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "Compiled for v4:2x2x2 (8 TPU v4 devices)" in out
  peak = next(line for line in out.splitlines() if line.strip().startswith("peak"))
  assert "(exact; fits in 34.36 GB)" in peak  # one SPMD island: train_step holds the state
  flops = next(line for line in out.splitlines() if line.strip().startswith("FLOPs per step"))
  assert "extrapolated from loop-free compiles" in flops
  ratio = float(flops.rsplit("compiled/analytic ", 1)[1].rstrip("]"))
  assert 0.95 < ratio < 1.15, flops


@pytest.mark.slow
@pytest.mark.tpu
def test_extrapolated_flops_equal_the_unrolled_steps_count():
  """XLA counts a loop's body once; the extrapolation from loop-free compiles recovers the count
  of the same step compiled with no loops (unrolled, one microbatch). Shapes are TPU-sized
  (8 sequences per device and microbatch, 128-multiples): XLA counts padded tiles, so a batch
  of 1 or 2 rows per device would not count linearly."""
  shapes = {k: v for k, v in SMALL_8B.items() if k.startswith("model.")}
  shapes.update({"model.num_layers": 3, "data.seq_len": 128, "train.global_batch": 128})
  loops = dryrun_compile.compile_for_topology(
    tpu_config("v4:2x2x2", **shapes, **{"model.scan_layers": True, "train.num_microbatches": 2})
  )
  (row,) = loops["islands"]
  assert row["flops_counted"] == "extrapolated from loop-free compiles"
  direct = dryrun_compile.compile_for_topology(tpu_config("v4:2x2x2", **shapes))
  (want,) = direct["islands"]
  assert want["flops_counted"] == "as compiled"
  assert row["flops"] == pytest.approx(want["flops"], rel=0.01)
  # The scanned step's compiled temporaries are real numbers from XLA, not the estimate.
  (step,) = [p for p in row["pieces"] if p["runs"]]
  assert step["name"] == "train_step" and step["temporaries"] > 0


@pytest.mark.slow
@pytest.mark.tpu
def test_pods_on_slices_and_pipeline_stages():
  """2 pods x 2 stages on two v4 slices: pod 0's two islands, each a set of compiled pieces whose
  peak is bounded by the resident state plus the largest piece; FLOPs counted per node."""
  c = tpu_config(
    "v4:2x2x1",
    **{
      "parallel.pods": 2,
      "parallel.stages": 2,
      "parallel.islands": 4,
      "train.num_microbatches": 2,
    },
  )
  out = dryrun_compile.compile_for_topology(c)
  assert (out["num_slices"], out["num_devices"]) == (2, 8)
  assert [r["island"] for r in out["islands"]] == ["island0", "island1"]
  for r in out["islands"]:
    assert r["peak_is"] == "upper bound" and r["fits"] is True
    step = [p for p in r["pieces"] if p["runs"]]
    assert r["peak_bytes"] == r["state_bytes"] + r["held_bytes"] + max(p["live"] for p in step)
    assert r["flops_counted"] == "as compiled"
    assert 0.9 < r["flops"] / r["analytic_flops"] < 1.2, r
  # Stage 0 keeps F's outputs of the microbatches in flight (both, at 2 stages and 2
  # microbatches, whatever the schedule); the last stage's FB keeps nothing between them.
  first, last = out["islands"]
  f0 = next(p for p in first["pieces"] if p["name"] == "F:0:0")
  assert first["held_bytes"] == 2 * f0["outputs"] > 0 and last["held_bytes"] == 0


@pytest.mark.tpu
def test_a_step_that_does_not_fit_is_reported_not_raised():
  """XLA refuses a program bigger than the chip's memory: the report says so in one line."""
  c = tpu_config(
    "v4:2x2x2",
    **{"model.num_layers": 1, "data.seq_len": 2048, "train.global_batch": 4096},
  )
  with c.unlocked():
    c.model.vocab_size = 32768
  text = dryrun_compile.report(c)
  last = text.splitlines()[-1]
  assert last.startswith("Compiled for v4:2x2x2 (8 TPU v4 devices): does NOT fit; XLA refused")
  assert "RESOURCE_EXHAUSTED" in last


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--config=configs/palm_tiny.py", "--dry_run", "--compile"], "needs hardware.topology"),
    (
      ["--config=configs/palm_8b.py", "--dry_run", "--compile", "--config.hardware.topology=v4"],
      "hardware.topology='v4' is not a TPU topology",
    ),
    (["--config=configs/palm_tiny.py", "--compile"], "give --dry_run --compile"),
  ],
  ids=["no_topology", "bad_topology", "compile_without_dry_run"],
)
@pytest.mark.processes
@pytest.mark.tpu
def test_bad_input_is_one_clear_line(flags, message):
  proc = run_main(*flags)
  assert proc.returncode != 0
  assert message in proc.stderr


@pytest.mark.tpu
def test_a_mesh_axis_that_is_no_product_of_torus_axes_splits_them():
  """jax.make_mesh refuses a 32-way axis on a 4x4x4 torus (no product of whole torus axes);
  backend.cluster.make_mesh splits physical axes instead, as PaLM 540B's tensor=12 on a
  8x16x24 pod needs."""
  from jax.experimental import topologies

  from pwtrain.backend.cluster import make_mesh

  dryrun_compile.topology_devices(tpu_config("v4:2x2x1"))  # sets libtpu's environment
  devices = topologies.get_topology_desc("v4:4x4x4", "tpu", chip_config_name="megacore").devices
  mesh = make_mesh({"fsdp": 32, "tensor": 2}, devices)
  assert dict(mesh.shape) == {"fsdp": 32, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
