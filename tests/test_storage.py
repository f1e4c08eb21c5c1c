"""Storage faults say one line and lose nothing: a save the disk refuses stops the run at once
with its committed checkpoints intact, so does a write of metrics.jsonl it refuses, a start the
disk refuses leaves no workdir behind, and a torn last row of metrics.jsonl is repaired on
resume. The diagnostics (a profile, trace.json) the disk refuses are a warning each, and the run
goes on.

A full disk is made here by a file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored, as a shell's
`ulimit -f` gives): every write past it fails in the kernel, in TensorStore's C++ writers as in
Python's, as a full disk fails them (EFBIG, "File too large", where a full disk says ENOSPC,
"No space left on device"); no filesystem can be mounted here.
"""

import functools
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, TINY, metrics_rows

from pwtrain import metrics as metrics_lib
from pwtrain.checkpoint import saving

FLAGS = [f"--config.{k}={v}" for k, v in TINY.items()] + [
  "--config.data.max_files=40",
  "--config.train.checkpoint_every=2",
  "--config.train.log_every=2",
  "--config.train.compile_cache_dir=off",
  "--progress=none",
]
LIMIT = 64 * 1024  # the checkpoint's array files are larger; metrics, logs and configs smaller
# Above a whole checkpoint of this model (1.4 MB: TensorStore may write all of its arrays into
# one file, 0.5 MB or more) and every file of its prepared data.
METRICS_LIMIT = 4 * 1024 * 1024


def _limited(limit=LIMIT):
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def _main(workdir, *args, limited=False, flags=FLAGS):
  """`python -m pwtrain.main` in a process of its own; `limited`: under the file size limit
  LIMIT (True) or under that many bytes. Only a limited start runs without the suite's
  compilation cache (its entries would be writes past the limit too); the others load their
  programs from it."""
  env = dict(os.environ)
  if limited:
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return subprocess.run(
    [sys.executable, "-m", "pwtrain.main", "--config=configs/palm_tiny.py", *flags,
     f"--workdir={workdir}", *args],
    cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    preexec_fn=functools.partial(_limited, LIMIT if limited is True else limited)
    if limited else None,
  )  # fmt: skip


def _lines(out) -> list[str]:
  """stderr's lines, less the platform line main prints first."""
  return [ln for ln in out.stderr.splitlines() if ln.strip() and "main.py" not in ln]


@pytest.mark.slow
@pytest.mark.processes
def test_a_save_the_disk_refuses_stops_the_run_at_once_in_one_line(tmp_path):
  """Steps 1-4 saved (2, 4); the resume's save of step 6 meets a full disk: one line naming
  the step, the directory, the OS error and the fix (once, as a run printed 3,335 lines and 408
  tracebacks, going on 10 steps to its next save); no step past the next save runs, 2 and 4
  stay committed, and the same command resumes from 4 once there is room."""
  workdir = tmp_path / "run"
  first = _main(workdir, "--config.train.num_steps=4")
  assert first.returncode == 0, first.stderr[-3000:]
  full = _main(workdir, "--config.train.num_steps=10", limited=True)
  assert full.returncode == 1, full.stderr[-3000:]
  lines = _lines(full)
  # "resumed from step 4", the changed num_steps, and the error.
  assert "Traceback" not in full.stderr and len(lines) == 3, full.stderr[-5000:]
  assert lines[-1] == (
    f"error: checkpoint 6 could not be written to {workdir}/checkpoints: File too large "
    "(EFBIG); the run stopped here and the latest checkpoint, step 4, is intact. Free space on "
    "that filesystem (or raise its quota or file size limit) and run the same command again "
    "to resume from it"
  )
  assert max(r["step"] for r in metrics_rows(workdir)) <= 8  # stopped by its next save
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  again = _main(workdir, "--config.train.num_steps=10")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from step 4" in again.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "6", "8"]


@pytest.mark.slow
@pytest.mark.processes
def test_a_metrics_write_the_disk_refuses_stops_the_run_in_one_line_and_the_resume_is_exact(
  tmp_path,
):
  """metrics.jsonl already holds all but ROOM bytes of what the file size limit allows (rows of
  step 0, which every start keeps), and the checkpoints (every 4 steps) fit under the limit:
  the rows of step 8 (about 1.1 KB an interval of 2 steps) meet it. One line names the file,
  the OS error, the step and the checkpoint kept, and the fix (a run printed a traceback); no
  step past 8 runs; checkpoint 4 is committed. The same command without the limit resumes from
  4, sets the torn row aside, runs steps 5-8 again with the very losses the first start logged
  for them, and finishes: steps 1-12 once each, every line a row."""
  room = 3900  # steps 2-6's intervals fit (3.3 KB), step 8's does not (4.4 KB)
  workdir = tmp_path / "run"
  workdir.mkdir()
  pad = json.dumps({"step": 0, "pad": "x" * 1000}) + "\n"
  count, rest = divmod(METRICS_LIMIT - room, len(pad))  # count - 1 rows, and one of the rest
  last = json.dumps({"step": 0, "pad": "x" * (len(pad) + rest - 23)}) + "\n"
  (workdir / "metrics.jsonl").write_text(pad * (count - 1) + last)
  assert (workdir / "metrics.jsonl").stat().st_size == METRICS_LIMIT - room
  flags = [f for f in FLAGS if "checkpoint_every" not in f] + ["--config.train.checkpoint_every=4"]
  full = _main(workdir, "--config.train.num_steps=12", limited=METRICS_LIMIT, flags=flags)
  assert full.returncode == 1, full.stderr[-3000:]
  lines = _lines(full)
  assert "Traceback" not in full.stderr and len(lines) == 1, full.stderr[-5000:]
  assert lines[0] == (
    f"error: {workdir}/metrics.jsonl could not be written: File too large (EFBIG); the run "
    "stopped at step 8 and the latest checkpoint, step 4, is intact. Free space on that "
    "filesystem (or raise its quota or file size limit) and run the same command again to "
    "resume from it, or start afresh with another --workdir"
  )
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]
  text = (workdir / "metrics.jsonl").read_text()
  assert len(text) == METRICS_LIMIT and not text.endswith("\n")  # torn at the limit
  first = {r["step"]: r["loss"] for r in map(json.loads, text.splitlines()[:-1]) if "loss" in r}
  assert set(first) == set(range(1, 9)) - {8} or set(first) == set(range(1, 9)), first

  again = _main(workdir, "--config.train.num_steps=12", flags=flags)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from step 4" in again.stderr and "1 torn line" in again.stderr
  rows = metrics_rows(workdir)  # every line parses
  assert sum(1 for r in rows if r.get("pad")) == count  # the rows of step 0 kept
  losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
  assert [s for s, _ in losses] == list(range(1, 13))
  assert {s: x for s, x in losses if s in first} == first  # steps 1-4 kept, 5-8 run again alike
  assert (workdir / "metrics.torn.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
@pytest.mark.processes
def test_diagnostics_the_disk_refuses_are_one_warning_each_and_the_run_goes_on(tmp_path):
  """The profile of steps 3-4 (train.profile_steps: a 6 MB file) meets a file size limit of
  2 MB (above a whole checkpoint, 1.2 MB) and trace.json (backend.trace) is /dev/full (ENOSPC):
  one warning line each, naming the file and the OS error, their partial files removed, and the
  run trains its 6 steps and saves them, rc 0. The profile's failure was a traceback and a dead
  run; trace.json's, a traceback after the run."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "trace.json").symlink_to("/dev/full")
  extra = ["--config.train.profile_steps=(2,4)", "--config.backend.trace=True"]
  out = _main(workdir, "--config.train.num_steps=6", *extra, limited=2 * 1024 * 1024)
  assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-5000:]
  warned = [ln.split("] ", 1)[1] for ln in _lines(out) if ln.startswith("W")]
  assert warned == [
    f"the profile of steps 3-4 could not be written to {workdir}/profile: File too large "
    "(EFBIG); the run goes on without it. Free space on that filesystem, or set "
    "train.profile_steps=() to profile nothing",
    f"{workdir}/trace.json could not be written: No space left on device (ENOSPC); the run goes "
    "on without its trace (backend.trace). Free space on that filesystem, or set "
    "backend.trace=False",
  ], out.stderr[-5000:]
  assert [r["step"] for r in metrics_rows(workdir) if "loss" in r] == list(range(1, 7))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]
  assert not (workdir / "profile").exists() and not os.path.lexists(workdir / "trace.json")


_EVENTS_CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (40 * 1024, resource.RLIM_INFINITY))
from pwtrain import metrics
from pwtrain.errors import WriteFailed
logger = metrics.MetricsLogger(
  sys.argv[1], start_step=0, num_steps=100, log_every=50, tokens_per_step=1,
  flops_per_token=1.0, num_devices=1, peak_flops_per_device=None, progress="none",
)
try:
  for step in range(1, 101):
    logger.record(step, {f"m{i}": step / (i + 1) for i in range(20)})
except WriteFailed as e:
  logger.close()
  print(e)
  sys.exit(3)
"""


@pytest.mark.processes
def test_a_tensorboard_write_the_disk_refuses_is_one_error_of_the_caller_not_a_hang(tmp_path):
  """TensorBoard's events of 50 steps (about 56 KB) pass a 40 KB file size limit, metrics.jsonl's
  rows (25 KB) do not: the write fails on the logging thread as WriteFailed naming the events
  file, and closing the logger after it is quiet. tensorboardX's own writer thread died of it
  with a traceback, and the run then blocked for good on its full queue."""
  out = subprocess.run(
    [sys.executable, "-c", _EVENTS_CHILD, str(tmp_path)],
    cwd=REPO, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
  (events,) = os.listdir(tmp_path / "tensorboard")
  assert out.stdout.strip() == (
    f"{tmp_path}/tensorboard/{events} could not be written: File too large (EFBIG)"
  )
  assert [r["step"] for r in metrics_rows(tmp_path)] == [*range(1, 51), 50]  # the rows, whole


@pytest.mark.processes
def test_a_start_the_disk_refuses_leaves_no_workdir(tmp_path):
  """The first write past the limit is the data's (a prepared dataset, in the workdir): one
  line naming the OS error, and the workdir this start made is gone."""
  workdir = tmp_path / "run"
  out = _main(workdir, limited=True)
  assert out.returncode == 1, out.stderr[-3000:]
  lines = _lines(out)
  assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-5000:]
  assert lines[0].startswith(f"error: a write under --workdir={workdir} failed: File too large")
  assert not workdir.exists()


def test_storage_failures_are_found_under_any_library_s_wording():
  enospc = OSError(28, "No space left on device")
  assert saving.storage_reason(enospc) == "No space left on device (ENOSPC)"
  tensorstore = ValueError("Failed to write 1010841 bytes to file 12: ... [os_error_code='27']")
  assert saving.storage_reason(tensorstore) == "File too large (EFBIG)"
  assert saving.storage_reason(RuntimeError("write() failed: Disk quota exceeded")).startswith(
    "Disk quota exceeded"
  )
  try:
    try:
      raise enospc
    except OSError as e:
      raise RuntimeError("commit failed") from e
  except RuntimeError as wrapped:
    assert saving.storage_reason(wrapped) == "No space left on device (ENOSPC)"
  assert saving.storage_reason(TypeError("'NoneType' object is not subscriptable")) is None


def test_a_refused_write_names_the_file_the_os_error_the_stop_and_the_fix():
  import errno

  from pwtrain.errors import WriteFailed

  eio = WriteFailed("/w/metrics.jsonl", OSError(errno.EIO, os.strerror(errno.EIO)))
  assert str(eio) == "/w/metrics.jsonl could not be written: Input/output error (EIO)"
  full = WriteFailed("/w/config.json", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
  assert str(full.stopped(1, None)) == (
    "/w/config.json could not be written: No space left on device (ENOSPC); the run stopped at "
    "step 1 and no checkpoint was written yet. Free space on that filesystem (or raise its "
    "quota or file size limit) and run the same command again, or start afresh with another "
    "--workdir"
  )


def _logger(workdir, start_step):
  return metrics_lib.MetricsLogger(
    str(workdir), start_step=start_step, num_steps=8, log_every=2, tokens_per_step=1,
    flops_per_token=1.0, num_devices=1, peak_flops_per_device=None, progress="none",
  )  # fmt: skip


def test_a_torn_last_row_of_the_metrics_is_set_aside_on_resume(tmp_path, caplog):
  """A full disk tore the last row (`..."loss": 0.754` with no end); the resume appended its
  first row to that line, unparseable for good. Now the resume moves the torn tail to
  metrics.torn.jsonl, says so in one line, and every line of metrics.jsonl parses."""
  logger = _logger(tmp_path, 0)
  for step in (1, 2, 3, 4):
    logger.record(step, {"loss": 1.0 / step})
  logger.close()
  path = tmp_path / "metrics.jsonl"
  whole = path.read_text()
  torn = whole[: whole.rindex('"loss"') + 12]  # mid-number of step 4's row: no newline
  path.write_text(torn)
  caplog.set_level(logging.INFO, logger="pwtrain")
  logger = _logger(tmp_path, 2)
  for step in (3, 4):
    logger.record(step, {"loss": 2.0})
  logger.close()
  rows = metrics_rows(tmp_path)  # every line parses
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
  assert (tmp_path / "metrics.torn.jsonl").read_text() == torn[torn.rindex("\n") + 1 :] + "\n"
  said = [r.getMessage() for r in caplog.records if "torn" in r.getMessage()]
  assert len(said) == 1 and str(path) in said[0], said
  json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_rollback_s_rewrite_of_the_metrics_the_disk_refuses_is_one_error(tmp_path):
  """A rollback (train.rollback_after) rewrites metrics.jsonl, the rows after its step moved to
  metrics.rolled_back.jsonl; that file is /dev/full (every write: ENOSPC). The rewind raises
  WriteFailed (train.py's one line and stop, as for any refused log write), not a bare OSError
  with a traceback, and closing the logger after it is quiet."""
  from pwtrain.errors import WriteFailed

  logger = _logger(tmp_path, 0)
  for step in (1, 2, 3, 4):
    logger.record(step, {"loss": 1.0 / step})
  logger.flush()
  (tmp_path / "metrics.rolled_back.jsonl").symlink_to("/dev/full")
  with pytest.raises(WriteFailed) as refused:
    logger.rewind(2, rollback_from=4)
  logger.close()
  assert str(refused.value) == (
    f"{tmp_path}/metrics.jsonl could not be written: No space left on device (ENOSPC)"
  )
  assert [r["step"] for r in metrics_rows(tmp_path) if "loss" in r] == [1, 2, 3, 4]  # as it was


def test_a_synchronous_save_in_parts_is_committed_when_save_returns(tmp_path):
  """train.async_checkpoint=False where a save is written in parts (remote islands, a
  distributed run of several islands: a commit thread of its own, here with distributed mode's
  part writer in one process): the step is committed when `save` returns, as in embedded mode
  (it was ignored there: the commit ran on while the steps went on)."""
  import jax.numpy as jnp
  import numpy as np

  from pwtrain.checkpoint import Checkpointer, ProcessParts

  state = {"w": jnp.asarray(np.random.default_rng(0).random((2048, 4096)), jnp.float32)}
  ckpt = Checkpointer(
    str(tmp_path / "checkpoints"), keep=3, every=1, async_save=False, part_writer=ProcessParts
  )
  try:
    for step in (1, 2):
      ckpt.save(step, state, {"pos": step})
      assert ckpt.all_steps() == list(range(1, step + 1))  # no wait: committed already
  finally:
    ckpt.close()


class _DiesNoisily:
  def __del__(self):
    raise RuntimeError("a thread's own unraisable error")


def test_a_damaged_restore_keeps_other_threads_errors_where_they_go(tmp_path, monkeypatch):
  """While a damaged checkpoint is read (its failure one line; what Orbax's abandoned reads
  print dropped), another thread's unraisable errors still reach the hook that was there: the
  restore swaps no process-wide hook (it once held and dropped every one while it read)."""
  import threading

  import test_reliability as damaged

  from pwtrain.checkpoint import Checkpointer

  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
  directory = str(tmp_path / "checkpoints")
  damaged._two_checkpoints(directory)
  damaged.DAMAGE["truncated array file"](os.path.join(directory, "2"))
  ckpt = Checkpointer(directory, keep=3, every=1)
  reading, emitted = threading.Event(), []

  def noisy():
    while not reading.is_set():
      time.sleep(0.01)
    while reading.is_set():
      _DiesNoisily()
      emitted.append(1)
      time.sleep(0.05)

  thread = threading.Thread(target=noisy)
  thread.start()
  reading.set()
  try:
    assert ckpt.restore_latest(damaged._abstract())[0] == 1
  finally:
    reading.clear()
    thread.join()
    ckpt.close()
  assert len(emitted) >= 5  # the read took its half second at least
  assert seen.count("a thread's own unraisable error") == len(emitted)


@pytest.mark.slow
@pytest.mark.processes
def test_a_launcher_log_the_disk_refuses_stops_the_run_in_one_line(tmp_path):
  """pwtrain.launch's log of process 0 is /dev/full (every write: ENOSPC): the launcher says so
  in one line naming the file, the OS error and the fix, and stops the run. Its echo thread
  died of the error with a traceback, and the processes' pipes were then read by nobody."""
  from test_distributed import PODS, launch

  logs = tmp_path / "logs"
  logs.mkdir()
  (logs / "process0.log").symlink_to("/dev/full")
  out = launch(tmp_path / "run", 2, {**PODS, "train.num_steps": 8}, extra=(f"--log_dir={logs}",))
  assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out.stdout[-3000:]
  said = [line for line in out.stdout.splitlines() if line.startswith("[launch]")]
  assert said == [
    f"[launch] {logs}/process0.log could not be written: No space left on device (ENOSPC); "
    "stopping the run, its latest checkpoint kept. Free space on that filesystem (or give "
    "another --log_dir) and run the same command again to resume"
  ], out.stdout[-3000:]
