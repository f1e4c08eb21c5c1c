"""The standalone server's reload thread (serve.reload): a reload that fails for any reason is
said in one line and tried again, and the last good weights stay served; a later good
checkpoint is then served."""

import json
import logging
import shutil
import time

import pytest
from helpers import small_config

from pwtrain import train
from pwtrain.serve.weights import CheckpointWeights


def _wait(predicate, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


@pytest.mark.slow
def test_a_reload_that_fails_is_said_and_the_thread_goes_on(tmp_path, caplog):
  """A newer checkpoint whose integrity record is malformed (its fingerprint a number: a
  TypeError while checking it, which the thread once died of without a word): one line, the
  old step still served; a good newer one is then served (the thread lived on)."""
  config = small_config(**{"train.num_steps": 2, "train.checkpoint_every": 2})
  workdir = tmp_path / "run"
  train.run(config, str(workdir), show_progress=False)
  checkpoints = workdir / "checkpoints"
  caplog.set_level(logging.INFO, logger="pwtrain")
  source = CheckpointWeights(config, str(workdir), reload=True, poll_s=0.05)
  try:
    assert source.step == 2
    shutil.copytree(checkpoints / "2", checkpoints / "3")
    (checkpoints / "3" / "integrity" / "metadata").write_text(json.dumps({"fingerprint": 5}))
    said = lambda: [r.getMessage() for r in caplog.records if "reloading" in r.getMessage()]  # noqa: E731
    _wait(lambda: said())
    time.sleep(0.5)  # more polls meet the same failure: said once
    assert len(said()) == 1 and "TypeError" in said()[0], said()
    assert "still serving checkpoint 2" in said()[0] and source.step == 2
    shutil.rmtree(checkpoints / "3")
    shutil.copytree(checkpoints / "2", checkpoints / "4")
    _wait(lambda: source.step == 4)
  finally:
    source.close()
