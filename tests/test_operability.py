"""A run on a cluster reads like a run on a laptop: plain lines in a log file, metrics that say
where the time went, and mistakes on the command line in one line."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from helpers import REPO, TINY, metrics_rows, small_config

from pwtrain import train
from pwtrain.checkpoint import IncompatibleCheckpoint
from pwtrain.goodput import Goodput

FLAGS = [f"--config.{k}={v}" for k, v in TINY.items()] + ["--config.data.max_files=40"]


def main(*args, env=None):
  return subprocess.run(
    [sys.executable, "-m", "pwtrain.main", "--config=configs/palm_tiny.py", *args],
    cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
  """A run as a cluster job has it: stdout to a file (not a terminal), no JAX_PLATFORMS set
  (the [tpu] extra, with libtpu, is installed), evaluation every 4 steps."""
  workdir = tmp_path_factory.mktemp("run")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = main(
    f"--workdir={workdir}", *FLAGS, "--config.train.num_steps=8", "--config.train.log_every=2",
    "--config.train.eval_every=4", "--config.train.eval_batches=1", env=env,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir, out


@pytest.mark.slow
def test_a_run_logged_to_a_file_prints_plain_lines(logged_run):
  _, out = logged_run
  assert "\r" not in out.stdout and "\r" not in out.stderr
  lines = out.stdout.splitlines()
  stamps = [time.strptime(line[:19], "%Y-%m-%d %H:%M:%S") for line in lines]  # when, in a file
  assert stamps == sorted(stamps)
  lines = [line[20:] for line in lines]
  assert [line.split(" | ")[0] for line in lines] == [
    "step 2/8",
    "step 4/8",
    "step 6/8",
    "step 8/8",
  ]
  for line in lines:
    fields = line.split(" | ")
    assert fields[1].startswith("loss ") and fields[2].endswith(" tokens/s"), line
    assert fields[3].startswith("step ") and fields[4].startswith("ETA "), line
    assert fields[5].startswith("memory ") and fields[5].endswith("(host RSS)"), line
  evals = [line for line in out.stderr.splitlines() if ": eval loss" in line]
  assert len(evals) == 2 and all(line.split("] ", 1)[1].startswith("step ") for line in evals)


def test_a_cpu_run_prints_no_libtpu_error(logged_run):
  _, out = logged_run
  assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "libtpu" not in out.stderr, out.stderr[:3000]
  (first,) = [line for line in out.stderr.splitlines() if "platform: " in line]
  assert first.split("] ", 1)[1].startswith("platform: cpu, 8 devices (simulated on the CPU")


def test_metrics_rows_say_where_the_time_went(logged_run):
  workdir, out = logged_run
  rows = metrics_rows(workdir)
  (once,) = [r for r in rows if "compile_s" in r]
  assert once["step"] == 0 and once["compile_s"] > 0
  intervals = [r for r in rows if "tokens_per_s" in r]
  assert [r["step"] for r in intervals] == [2, 4, 6, 8]
  steps = [r for r in rows if "loss" in r]
  assert [r["step"] for r in steps] == list(range(1, 9))
  assert all(r["param_norm"] > 0 and r["update_norm"] > 0 for r in steps), steps
  for r in intervals:
    for key in ("time", "elapsed_s", "step_time_s", "data_wait_s", "host_rss_bytes"):
      assert key in r, (key, r)
    assert 0 < r["goodput"] <= 1
    shares = [v for k, v in r.items() if k.startswith("badput_")]
    assert len(shares) == 8 and abs(r["goodput"] + sum(shares) - 1) < 1e-6, r
  assert intervals[-1]["badput_eval"] > 0 and intervals[-1]["badput_compile"] > 0
  times = [r["time"] for r in intervals]
  assert times == sorted(times)
  (summary,) = [line for line in out.stderr.splitlines() if "trained steps" in line]
  assert "tokens/s on average" in summary and "goodput " in summary


def test_goodput_counts_the_step_loops_of_every_start():
  """A run restarted in its process (remote mode, after a lost worker): each start's step loop
  is productive time less its badput; the time between the loops is `other`."""
  goodput = Goodput(start=0.0)
  goodput.begin_loop(now=10.0)
  goodput.add("data_wait", 2.0)
  goodput.end_loop(now=30.0)  # the first start fails at 30 s and restarts
  goodput.begin_loop(now=50.0)
  assert goodput.productive_s(now=60.0) == 20.0 + 10.0 - 2.0
  row = goodput.row(now=60.0)
  assert row["goodput"] == 28.0 / 60 and row["badput_other"] == 30.0 / 60
  assert goodput.loop_start == 10.0  # training had begun: a failed start undoes nothing


@pytest.mark.parametrize(
  "flag,message",
  [
    ("--config.train.num_stpes=5",
     "error: unknown key train.num_stpes; did you mean train.num_steps?"),
    ("--config.trian.num_steps=5",
     "error: unknown section trian.num_steps; did you mean train.num_steps?"),
  ],
)  # fmt: skip
@pytest.mark.processes
def test_a_misspelled_key_or_section_is_one_line(flag, message, tmp_path):
  out = main(f"--workdir={tmp_path / 'run'}", flag)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines() == [message], out.stderr[-3000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.processes
def test_the_workdir_is_required_and_the_config_can_be_printed(tmp_path):
  out = main("--config.train.num_steps=7")
  assert out.returncode != 0 and out.stderr.strip().splitlines() == [
    "error: --workdir is required: the directory for checkpoints and metrics"
  ]
  printed = main("--print_config", "--config.train.num_steps=7")
  assert printed.returncode == 0 and "num_steps: 7" in printed.stdout


@pytest.mark.slow
def test_a_resume_names_every_changed_setting_and_keeps_each_starts_config(tmp_path, caplog):
  """A resume names the settings changed since the last start that trained; a start with
  nothing to train says so before compiling and leaves the record as it was; a start refused
  after compiling leaves the workdir's whole tree, its compilation cache included, as it was."""
  base = {"train.num_steps": 2, "train.checkpoint_every": 2}
  train.run(small_config(**base), str(tmp_path), show_progress=False)
  changed = small_config(**{**base, "train.num_steps": 4, "optim.lr": 0.02})
  with caplog.at_level(logging.WARNING, logger="pwtrain"):
    result = train.run(changed, str(tmp_path), show_progress=False)
  assert result.start_step == 2
  lines = [r.getMessage() for r in caplog.records if "changed setting" in r.getMessage()]
  assert lines == [
    f"resuming at step 2 with a changed setting: optim.lr: {small_config().optim.lr!r} -> 0.02",
    "resuming at step 2 with a changed setting: train.num_steps: 2 -> 4",
  ]
  assert (tmp_path / "config.0.json").is_file() and (tmp_path / "config.2.json").is_file()
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="pwtrain"):
    again = train.run(
      small_config(**{**base, "train.num_steps": 4, "optim.lr": 0.05}),
      str(tmp_path),
      show_progress=False,
    )
  assert again.start_step == again.final_step == 4 and again.state is not None
  assert any("nothing to train" in r.getMessage() for r in caplog.records)
  assert not any("compiled pieces" in r.getMessage() for r in caplog.records), caplog.text
  assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 0.02
  assert not (tmp_path / "config.4.json").exists()  # it trained nothing with lr 0.05
  # A start refused after compiling into the workdir's own compilation cache.
  cache = tmp_path / "compile_cache"
  (cache / "pieces").mkdir(parents=True)
  (cache / "an-entry-cache").write_bytes(b"kept")
  before = _tree(tmp_path)
  wider = small_config(
    **{**base, "train.num_steps": 6, "model.d_model": 128, "train.compile_cache_dir": str(cache)}
  )
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="pwtrain"):
    with pytest.raises(ValueError, match="does not match this config's model") as refused:
      train.run(wider, str(tmp_path), show_progress=False)
  assert isinstance(refused.value.__cause__, IncompatibleCheckpoint)
  (built,) = [r.getMessage() for r in caplog.records if "compiled pieces" in r.getMessage()]
  assert f"from {cache / 'pieces'} " in built and " 0 traced and saved" not in built, built
  assert _tree(tmp_path) == before


def _tree(root):
  """{path: contents} of every file under `root`, and every directory as None."""
  return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")}


def test_a_refused_run_leaves_the_workdir_as_it_was(tmp_path):
  """The vocabulary check comes after the corpus is built: a refused start removes what it
  wrote (the whole workdir if it made it; else only its new entries)."""
  too_small = small_config(**{"model.vocab_size": 200})  # the byte tokenizer has 258 ids
  fresh = tmp_path / "fresh"
  with pytest.raises(ValueError, match="model.vocab_size=200 is smaller"):
    train.run(too_small, str(fresh), show_progress=False)
  assert not fresh.exists()
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="model.vocab_size=200 is smaller"):
    train.run(too_small, str(kept), show_progress=False)
  assert [p.name for p in kept.iterdir()] == ["notes.txt"]


@pytest.mark.processes
def test_native_notices_stay_off_a_processs_own_console():
  """pwtrain/console.py: Gloo's notices, written by native code straight to file descriptor 1
  (two may share a line), are dropped; Python's lines and any other native line pass, in order,
  also when the process leaves by os._exit after flushing."""
  script = """
import os, sys
from pwtrain import console
console.drop_native_notices()
print("first", flush=True)
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ")
os.write(1, b"ranks is : 1[Gloo] Rank 1 is connected to 1 peer ranks. Expected ... : 1\\n")
os.write(1, b"a native line\\n")
print("last")
console.flush()
os._exit(3)
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert out.returncode == 3 and out.stdout == "first\na native line\nlast\n", out


def test_a_start_imports_no_torch():
  """A `pwtrain.main` start imports no torch (tensorboardX's package imports it where it is
  installed, as here: a second and more of each start; pwtrain/events.py)."""
  out = subprocess.run(
    [sys.executable, "-c", "import sys, pwtrain.main; print('torch' in sys.modules)"],
    cwd=REPO, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
