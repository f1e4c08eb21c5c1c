"""Bad configs fail early with a ValueError naming the key, the value and what is valid."""

import os
import subprocess
import sys

import jax
import pytest
from helpers import REPO, load_config, tiny_test_config

from pwtrain import config as config_lib
from pwtrain.errors import ConfigError, DataError, UserError
from pwtrain.models import arithmetic
from pwtrain.parallel import plan as plan_lib


@pytest.mark.parametrize("name", ["palm_tiny", "palm_1b", "palm_8b", "palm_62b", "palm_540b"])
def test_shipped_configs_validate(name):
  config = load_config(name)
  config_lib.validate(config)
  assert config.is_locked
  # Its docstring gives the command that runs it.
  assert f"python -m pwtrain.main --config={name} " in config_lib.shipped()[name].read_text()


def test_configs_ship_in_the_package_and_paths_still_work():
  shipped = config_lib.shipped()
  files = sorted(p.stem for p in (REPO / "pwtrain" / "configs").glob("*.py"))
  assert list(shipped) == [f for f in files if f != "__init__"] and "palm_tiny" in shipped
  assert config_lib.resolve("palm_8b:x") == f"{shipped['palm_8b']}:x"
  assert config_lib.resolve("configs/palm_tiny.py") == "configs/palm_tiny.py"  # a path as it is
  assert (REPO / "configs" / "palm_tiny.py").samefile(shipped["palm_tiny"])
  with pytest.raises(ConfigError, match="did you mean palm_tiny[?] The shipped configs: gemma2_2b"):
    config_lib.resolve("palm_tyni")


@pytest.mark.processes
def test_a_shipped_config_is_named_from_any_directory(tmp_path):
  """`--config=<name>` away from the repository (this tree's pwtrain on the path, as installed);
  an unknown name is one line naming the closest and listing the shipped configs."""
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  main = [sys.executable, "-m", "pwtrain.main", "--print_config"]
  run = lambda *args: subprocess.run(
    [*main, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
  )
  printed = run("--config=palm_tiny_pipeline", "--config.train.num_steps=7")
  assert printed.returncode == 0, printed.stderr[-2000:]
  assert "stages: 4" in printed.stdout and "num_steps: 7" in printed.stdout
  wrong = run("--config=palm_tyni")
  assert wrong.returncode != 0 and wrong.stderr.strip().splitlines() == [
    "error: --config=palm_tyni names no shipped config and no file; did you mean palm_tiny? The "
    f"shipped configs: {', '.join(config_lib.shipped())}; or give a config file's path"
  ]


@pytest.mark.parametrize(
  "name,layers,heads,d_model,billions",
  [
    ("palm_8b", 32, 16, 4096, 8.6),
    ("palm_62b", 64, 32, 8192, 62.5),
    ("palm_540b", 118, 48, 18432, 540.35),
  ],
)
def test_paper_shapes(name, layers, heads, d_model, billions):
  m = load_config(name).model
  assert (m.num_layers, m.num_heads, m.d_model, m.d_ff) == (layers, heads, d_model, 4 * d_model)
  # 256k ids; palm_540b pads them to a multiple of its parallel.tensor=12 (256008).
  assert m.vocab_size == (256_008 if name == "palm_540b" else 256_000)
  assert load_config(name).data.seq_len == 2048
  # PaLM Table 1 / section 2 parameter counts, within 1%.
  assert (
    abs(arithmetic.param_count(load_config(name).model, load_config(name).moe) / 1e9 - billions)
    / billions
    < 0.01
  )


def plan(**overrides):
  config = tiny_test_config(**overrides)
  config_lib.validate(config)
  return plan_lib.build(config, plan_lib.make_cluster(config))


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"parallel.data": 3},
      "parallel.data * parallel.fsdp * parallel.expert * parallel.tensor = 3 * 1 * 1 * 1 = 3",
    ),
    ({"parallel.data": -1, "parallel.fsdp": 16}, "parallel.data=-1 cannot be filled"),
    ({"parallel.data": -1, "parallel.fsdp": -1}, "only one of parallel."),
    (
      {"parallel.data": 1, "parallel.tensor": 8, "model.num_heads": 4, "model.num_kv_heads": 1},
      "parallel.tensor=8 does not divide model.num_heads=4",
    ),
    (
      {"parallel.data": 1, "parallel.fsdp": 8, "model.d_model": 60},
      "parallel.fsdp=8 does not divide model.d_model=60",
    ),
    ({"train.global_batch": 12}, "train.global_batch=12 must be divisible by"),
    (
      {"parallel.data": 4, "parallel.tensor": 2, "train.num_microbatches": 8},
      "parallel.data * parallel.fsdp * parallel.expert * train.num_microbatches = 1 * 4 * 8 = 32",
    ),
    ({"parallel.islands": 3}, "parallel.islands=3"),
    ({"parallel.islands": 0}, "parallel.islands=0 must be >= 1"),
    ({"parallel.islands": 2, "parallel.devices_per_island": 8}, "needs 16 devices"),
    ({"parallel.fsdp": 0}, "parallel.fsdp=0 must be a positive size or -1"),
  ],
)
def test_bad_parallel_layout(overrides, message):
  assert len(jax.devices()) == 8
  with pytest.raises(ValueError, match=".*".join(map(__import__("re").escape, [message]))):
    plan(**overrides)


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"model.num_kv_heads": 3}, "model.num_kv_heads=3 must divide model.num_heads=8"),
    ({"model.head_dim": 7}, "model.head_dim=7 must be even"),
    ({"model.num_layers": 0}, "model.num_layers=0 must be a positive integer"),
    ({"model.dtype": "float64"}, "model.dtype='float64' is not supported; valid: float32"),
    ({"optim.name": "lamb"}, "optim.name='lamb' is not an optimizer; valid: adafactor, adamw"),
    ({"data.tokenizer": "wordpiece"}, "data.tokenizer='wordpiece' is not a tokenizer; valid: byte"),
    ({"backend.mode": "cloud"}, "backend.mode='cloud' is not a backend"),
    (
      {"exchange.mode": "gossip"},
      "exchange.mode='gossip' is not supported; valid: diloco, overlapped, stale, sync",
    ),
    ({"exchange.compression": "fp4"}, "exchange.compression='fp4' is not supported"),
    ({"exchange.error_feedback": True}, "exchange.error_feedback=True needs"),
    ({"exchange.inner_steps": 0}, "exchange.inner_steps=0 must be >= 1"),
    ({"train.num_microbatches": 3}, "train.num_microbatches=3 does not divide train.global_batch"),
    ({"parallel.virtual_stages": 2}, "parallel.virtual_stages=2 is for parallel.schedule="),
    (
      {"parallel.schedule": "interleaved", "parallel.stages": 2, "parallel.virtual_stages": 3},
      "cuts model.num_layers=2 into parallel.stages x parallel.virtual_stages = 2 x 3 = 6 equal",
    ),
    (
      {
        "parallel.schedule": "interleaved",
        "parallel.stages": 2,
        "model.num_layers": 4,
        "parallel.virtual_stages": 2,
        "train.num_microbatches": 1,
      },
      "train.num_microbatches=1 must be a multiple of it",
    ),
    ({"parallel.schedule": "interleaved"}, "'interleaved' needs parallel.stages >= 2"),
    ({"fault.heartbeat_s": 0.0}, "fault.heartbeat_s=0.0 must be > 0"),
    (
      {"backend.mode": "remote", "backend.launch_workers": True, "fault.progress_timeout_s": -1.0},
      "fault.progress_timeout_s=-1.0 must be >= 0 (0: never)",
    ),
  ],
)
def test_bad_values(overrides, message):
  import re

  with pytest.raises(ValueError, match=re.escape(message)):
    config_lib.validate(tiny_test_config(**overrides))


def run_main(*args):
  return subprocess.run(
    [sys.executable, "-m", "pwtrain.main", "--config=configs/palm_tiny.py", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.processes
def test_unknown_key_on_the_command_line_is_refused(tmp_path):
  result = run_main(f"--workdir={tmp_path}", "--config.train.num_stepz=5")
  assert result.returncode != 0
  assert "num_stepz" in result.stderr
  assert not list(tmp_path.iterdir())  # nothing was written


@pytest.mark.parametrize(
  "args,message",
  [
    (["--config.parallel.tensor=3"], "error: parallel.tensor=3 does not divide model.num_heads=8"),
    (["--config.train.global_batch=12"], "error: train.global_batch=12 must be divisible by"),
    (["--config.train.global_batch=12", "--dry_run"], "error: train.global_batch=12 must be"),
  ],
)
@pytest.mark.processes
def test_bad_value_on_the_command_line_is_one_line_naming_the_key(args, message, tmp_path):
  """Training and the dry run alike: one line naming the key and what is valid, no traceback,
  nothing written (the layout is checked against the devices before the data is prepared)."""
  result = run_main(f"--workdir={tmp_path / 'run'}", *args)
  assert result.returncode == 1
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines and lines[-1].startswith(message), result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert not (tmp_path / "run").exists()


def test_user_errors_are_value_errors_and_name_the_key():
  """main prints a UserError as one line; code that catches ValueError keeps working."""
  config = tiny_test_config()
  config.train.log_every = 0
  with pytest.raises(ConfigError, match=r"train\.log_every=0 must be a positive integer"):
    config_lib.validate(config)
  assert issubclass(ConfigError, UserError) and issubclass(DataError, UserError)
  assert issubclass(UserError, ValueError)
