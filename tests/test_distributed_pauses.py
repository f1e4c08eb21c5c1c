"""Silent and compound faults of elastic pods in distributed mode, under pwtrain.launch, with
real signals from outside the run: a process SIGSTOPped for less than detection and SIGCONTed
costs only the pause (no pod dropped, no step run twice); pod 0's process (the coordination
service's) SIGKILLed while pod 1's new process rejoins is a loss the launcher restarts the run
from (fault.max_restarts), not a hang.

The remote-mode counterparts are in test_silent_faults.py.
"""

import os
import signal
import threading
import time

import pytest
from helpers import SGD, RowTimes, metrics_rows
from signals import Kill, Killer, child_with_env
from test_distributed import launch, process_logs

# 2 pods as 2 processes of 1 device each, a data stream each, elastic. JAX's heartbeat timeout
# is 3 x fault.heartbeat_s (6 s), the launcher's and the peers' liveness bound 10 s
# (pwtrain/liveness.py).
TWO = {
  **SGD,
  "parallel.islands": 2,
  "parallel.devices_per_island": 1,
  "parallel.pods": 2,
  "exchange.mode": "sync",
  "train.global_batch": 4,
  "data.streams": 2,
  "train.num_steps": 8,
  "train.log_every": 1,
  "train.checkpoint_every": 100,
  "train.eval_every": 0,
  "fault.elastic": True,
  "fault.heartbeat_s": 2.0,
}
PAUSE_S = 1.5  # a quarter of JAX's heartbeat timeout: well under every detection


def _process(run, i: int):
  return lambda: child_with_env(run.pid, "PWTRAIN_PROCESS_ID", str(i))


@pytest.mark.slow
@pytest.mark.processes
def test_a_process_stopped_shorter_than_detection_costs_the_pause_and_no_step_twice(tmp_path):
  """Process 1 SIGSTOPped from outside after step 3's row for PAUSE_S, then SIGCONTed: its JAX
  heartbeats and its liveness beat resume before any detection (JAX's 6 s, the launcher's and
  the peers' 10 s), so no pod is dropped, nothing is killed or started again, and nothing runs
  twice: metrics.jsonl holds steps 1-8 once each, in order (a step written again, as after a
  drop that ran it again, would show twice), both pods live in every row, and the launcher
  exits 0. The longest gap between two rows is under the pause plus a few steps."""
  rows = RowTimes(tmp_path)
  run = launch(tmp_path, 2, TWO, devices=1, background=True)
  stop = Kill(after=3, pid=_process(run, 1), sig=signal.SIGSTOP)
  killer = Killer(tmp_path, [stop], seed=3)
  resumed: dict = {}

  def resume():
    while stop.at is None and killer.error is None:
      time.sleep(0.01)
    if stop.at is not None:
      time.sleep(max(0.0, stop.at + PAUSE_S - time.time()))
      try:
        os.kill(stop.sent_to, signal.SIGCONT)
        resumed["at"] = time.time()
      except ProcessLookupError:  # killed as stopped (a pause longer than detection)
        pass

  waker = threading.Thread(target=resume, daemon=True)
  waker.start()
  try:
    stdout = run.communicate(timeout=300)[0].decode()
  finally:
    if run.poll() is None:
      run.kill()
    if stop.sent_to:
      try:
        os.kill(stop.sent_to, signal.SIGCONT)  # never left behind stopped
      except ProcessLookupError:
        pass
  killer.join()
  waker.join(5)
  rows.stop()
  logs = process_logs(tmp_path)
  assert run.returncode == 0, stdout[-3000:] + logs[-3000:]
  train_rows = [row for row in metrics_rows(tmp_path) if "loss" in row]
  assert [row["step"] for row in train_rows] == list(range(1, 9)), train_rows
  assert [row["pods_live"] for row in train_rows] == [2] * 8, train_rows
  for said in (" lost", "no progress", "started again", "restart", "rejoined"):
    assert said not in stdout, (said, stdout[-3000:])
  assert not (tmp_path / "metrics.rolled_back.jsonl").exists()
  assert resumed["at"] - stop.at >= PAUSE_S
  times = [rows.at[s] for s in sorted(rows.at)]
  gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
  steady, longest = gaps[len(gaps) // 2], gaps[-1]
  assert longest < PAUSE_S + max(5 * steady, 3.0), (longest, steady)
  print(f"stopped {resumed['at'] - stop.at:.2f} s: longest gap {longest:.2f} s, step {steady:.2f}")


def _compiled_again(log) -> bool:
  """Whether process 1, started again, has built its programs and opened its data (it then
  says it is ready, is welcomed, meets the others and pulls its pod's state: its rejoin)."""
  text = log.read_text() if log.exists() else ""
  return "reads data streams" in text.partition("[launch] started again")[2]


@pytest.mark.slow
@pytest.mark.processes
def test_pod_0_killed_while_pod_1_rejoins_restarts_the_run_from_the_checkpoint(tmp_path):
  """Process 1 SIGKILLed after step 2; the launcher starts it again, and the live process waits
  for it at step 7 (`rejoin:pod1@step7`). Once step 6's row is written and process 1, started
  again, has built its programs (it is about to say it is ready, be welcomed and pull its pod's
  state), process 0 (pod 0's, which serves the coordination service and holds the state pod 1
  copies) is SIGKILLed: the rejoin cannot finish. The launcher names process 0 in one
  line, stops process 1, restarts both (fault.max_restarts=1) and they resume from the step-4
  checkpoint: the run ends 0 with steps 1-8 each once in metrics.jsonl (those after the
  checkpoint set aside and run again), no traceback or crash dump on the console, and no wait
  for anything's timeout."""
  overrides = {
    **TWO,
    "train.checkpoint_every": 4,
    "fault.max_restarts": 1,
    "fault.inject": "rejoin:pod1@step7",
  }
  start = time.monotonic()
  run = launch(tmp_path, 2, overrides, devices=1, background=True)
  killer = Killer(tmp_path, [Kill(after=2, pid=_process(run, 1))], seed=4)
  lines: list[str] = []
  killed: dict = {}

  def read():
    for raw in run.stdout:
      lines.append(raw.decode(errors="replace"))

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 300
    pid = None  # process 0's, the first attempt's: found once, the kill waits on nothing else
    while not killed and time.monotonic() < deadline and run.poll() is None:
      pid = pid or _process(run, 0)()
      steps = {row["step"] for row in metrics_rows(tmp_path, running=True) if "loss" in row}
      if 6 in steps and pid and _compiled_again(tmp_path / "launch" / "process1.log"):
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, rejoined=any("pod 1 rejoined" in line for line in lines))
      time.sleep(0.02)
    run.wait(timeout=300)
  finally:
    if run.poll() is None:
      run.kill()
  reader.join(10)
  killer.join()
  stdout = "".join(lines)
  logs = process_logs(tmp_path)
  assert killed, stdout[-3000:]
  assert not killed["rejoined"], "the rejoin was over before process 0 was killed"
  assert run.returncode == 0, stdout[-3000:] + logs[-3000:]
  launcher = [line for line in stdout.splitlines() if line.startswith("[launch]")]
  assert any(
    line.startswith(f"[launch] process 0 (pid {killed['pid']}) was killed by SIGKILL")
    and "stopping the other processes" in line
    for line in launcher
  ), launcher
  assert "[launch] restarting all 2 processes (1 of 1)" in launcher, launcher
  assert "resumed from step 4" in stdout, stdout[-3000:]
  steps = [row["step"] for row in metrics_rows(tmp_path) if "loss" in row]
  assert steps == list(range(1, 9)), steps
  shown = [line.split("] ", 1)[-1] for line in stdout.splitlines()]
  assert not any(line.startswith("Traceback") or "Fatal Python error" in line for line in shown)
  print(
    f"pod 0 killed during pod 1's rejoin: run restarted, done in {time.monotonic() - start:.0f} s"
  )
