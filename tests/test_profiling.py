"""A jax.profiler trace of chosen steps, with the controller's node names in it."""

import glob
import os

import pytest
from helpers import random_batches, tiny_test_config

from pwtrain.harness import Harness
from pwtrain.profiling import StepProfiler


def test_profile_of_chosen_steps_names_the_nodes(tmp_path):
  config = tiny_test_config()
  batches = random_batches(config, 3)
  profiler = StepProfiler(str(tmp_path), (1, 2))
  with Harness.build(config) as harness:
    state = harness.init()
    for i, batch in enumerate(batches):
      profiler.before_step(i)
      out = harness.step(state, batch, i)
      state = out.state
      profiler.after_step(i + 1, lambda out=out: out.metrics.result())
  assert not profiler.active
  traces = glob.glob(os.path.join(tmp_path, "profile", "plugins", "profile", "*", "*.xplane.pb"))
  assert len(traces) == 1, traces
  with open(traces[0], "rb") as f:
    content = f.read()
  assert b"train_step" in content and b"batch_in" in content


@pytest.mark.parametrize("steps", [(2, 2), (3, 1), (1,), (-1, 2)])
def test_bad_profile_steps_name_the_key(tmp_path, steps):
  with pytest.raises(ValueError, match=r"train.profile_steps=.* must be \(start, stop\)"):
    StepProfiler(str(tmp_path), steps)
