"""pwtrain.config.load (the one config loader) and the Harness's own contract; the harness's
steps are exercised by every test that trains (helpers.run_program, train.run)."""

import pytest
from helpers import REPO, load_config, tiny_test_config

from pwtrain import config as config_lib
from pwtrain.harness import Harness

TINY_FILE = REPO / "configs" / "palm_tiny.py"


def test_load_applies_dotted_overrides_at_any_depth():
  config = config_lib.load(TINY_FILE, {"seed": 3, "parallel.data": 2, "optim.name": "sgd"})
  assert (config.seed, config.parallel.data, config.optim.name) == (3, 2, "sgd")
  assert config_lib.load(TINY_FILE) == load_config("palm_tiny")


def test_load_passes_the_arg_after_a_colon():
  # palm_8b builds on palm_tiny through base_config(..., arg): the arg reaches get_config.
  assert config_lib.load(f"{REPO / 'configs' / 'palm_8b.py'}:anything").model.num_layers == 32


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"model.num_layer": 2}, "config override 'model.num_layer': palm_tiny.py has no key"),
    ({"modle.num_layers": 2}, "config override 'modle.num_layers': palm_tiny.py has no section"),
    ({"seed.x": 2}, "palm_tiny.py has no section 'seed'"),
    ({"model.num_layers": "two"}, "config override model.num_layers='two'"),
  ],
)
def test_load_refuses_unknown_keys_and_wrong_types(overrides, message):
  with pytest.raises(ValueError, match=message):
    config_lib.load(TINY_FILE, overrides)


def test_load_names_a_missing_file():
  with pytest.raises(ValueError, match="no_such_config.py.*does not exist"):
    config_lib.load(REPO / "configs" / "no_such_config.py")


def test_harness_refuses_devices_with_a_cluster_and_trace_with_a_controller():
  config = tiny_test_config()
  with pytest.raises(ValueError, match="`devices` or a `cluster`"):
    Harness.build(config, [], cluster=object())
  with pytest.raises(ValueError, match="for a new controller"):
    Harness.build(config, controller=object(), trace=object())
