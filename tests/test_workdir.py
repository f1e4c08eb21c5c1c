"""One run per workdir (a real second process is refused; a dead holder's lock is taken over),
and the resolved config saved in it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import load_config

from pwtrain import metrics
from pwtrain import workdir as workdir_lib

HOLD = """
import sys, time
from pwtrain.workdir import WorkdirLock
lock = WorkdirLock(sys.argv[1]).acquire()
print("LOCKED", flush=True)
time.sleep(120)
"""


def _holder(path):
  proc = subprocess.Popen(
    [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
  )
  assert proc.stdout.readline().strip() == "LOCKED"
  return proc


@pytest.mark.processes
def test_a_second_run_on_the_workdir_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
  holder = _holder(tmp_path)
  try:
    with pytest.raises(ValueError) as e:
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    message = str(e.value)
    assert f"--workdir={tmp_path} is in use by another run: pid {holder.pid} on host" in message
    assert os.path.join(str(tmp_path), ".lock") in message
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The holder died without releasing anything: its lock went with it.
  deadline = time.monotonic() + 10
  while True:
    try:
      lock = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
      break
    except ValueError:
      assert time.monotonic() < deadline, "the dead holder's lock was never released"
      time.sleep(0.1)
  with open(lock.path) as f:
    assert json.load(f)["pid"] == os.getpid()
  lock.release()
  with workdir_lib.WorkdirLock(str(tmp_path)):  # and again, once released
    pass


def test_the_resolved_config_is_saved_per_start_with_what_changed(tmp_path):
  config = load_config("palm_tiny")
  assert workdir_lib.config_changes(str(tmp_path), config, 0) == []
  workdir_lib.save_config(str(tmp_path), config)
  with open(tmp_path / "config.json") as f:
    saved = json.load(f)
  assert saved["model"]["d_model"] == config.model.d_model
  assert saved["parallel"]["stages"] == config.parallel.stages
  # Where the run happens (worker ports, a process's id, the coordinator) is no change.
  changed = load_config(
    "palm_tiny",
    {
      "optim.lr": 0.02,
      "train.num_steps": 400,
      "backend.workers": ("127.0.0.1:4001",),
      "backend.coordinator": "127.0.0.1:9",
      "backend.process_id": 3,
    },
  )
  assert workdir_lib.config_changes(str(tmp_path), changed, 60) == [
    f"optim.lr: {config.optim.lr!r} -> 0.02",
    "train.num_steps: 300 -> 400",
  ]
  workdir_lib.save_config(str(tmp_path), changed, start_step=60)
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "config.0.json",
    "config.60.json",
    "config.json",
  ]
  assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 0.02


def test_rows_after_a_resume_point_are_set_aside(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)] + [{"step": 4, "tokens_per_s": 9}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  returned = metrics.set_aside_after(str(path), 2)
  kept = [json.loads(line) for line in path.read_text().splitlines()]
  moved = [
    json.loads(line) for line in (tmp_path / "metrics.rolled_back.jsonl").read_text().splitlines()
  ]
  assert [r["step"] for r in kept] == [1, 2]
  assert [r["step"] for r in moved] == [3, 4, 4] and returned == moved
