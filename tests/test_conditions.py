"""No setting is silently ignored (pwtrain/conditions.py): every key that is read only under
another setting is refused, naming both, when it is set while that setting says it is not read;
and it is accepted where it is read."""

import contextlib

import pytest
from helpers import load_config, small_config

from pwtrain import conditions, defaults, train
from pwtrain import config as config_lib
from pwtrain.errors import ConfigError

AUTO = '("auto" is cosine for adamw, else rsqrt)'
# Per rule (by its `needs`): overrides under which it does not hold, and under which it does.
SETTINGS = {
  "data.dataset='files'": ({}, {"data.dataset": "files"}),
  "data.dataset='pystdlib'": ({"data.dataset": "files"}, {}),
  "data.tokenizer='sentencepiece' or 'huggingface'": ({}, {"data.tokenizer": "huggingface"}),
  "data.tokenizer='huggingface'": ({}, {"data.tokenizer": "huggingface"}),
  "data.tokenizer='sentencepiece' and data.tokenizer_path=''": (
    {"data.tokenizer": "huggingface"},
    {"data.tokenizer": "sentencepiece"},
  ),
  "train.eval_every >= 1": ({"train.eval_every": 0}, {}),
  "train.rollback_after >= 1": ({"train.rollback_after": 0}, {}),
  "train.objective='grpo'": ({}, {"train.objective": "grpo", "train.eval_every": 0}),
  "train.objective='grpo' and rl.task=''": (
    {"train.objective": "grpo", "train.eval_every": 0, "rl.task": "shift"},
    {"train.objective": "grpo", "train.eval_every": 0},
  ),
  "train.compile_cache_dir other than 'off'": ({"train.compile_cache_dir": "off"}, {}),
  "optim.name='adamw'": ({}, {"optim.name": "adamw"}),
  "optim.name='adafactor'": ({"optim.name": "sgd"}, {}),
  "optim.name='adafactor' or 'adamw'": ({"optim.name": "sgd"}, {}),
  f"optim.schedule='rsqrt' {AUTO}": ({"optim.name": "adamw"}, {}),
  f"optim.schedule='cosine' or 'linear' or 'wsd' {AUTO}": ({}, {"optim.name": "adamw"}),
  f"optim.schedule='wsd' {AUTO}": ({}, {"optim.schedule": "wsd"}),
  "parallel.stages >= 2": ({}, {"parallel.stages": 2}),
  "(parallel.stages >= 2) or (parallel.pods >= 2 and exchange.mode='overlapped')": (
    {"parallel.pods": 2},
    {"parallel.pods": 2, "exchange.mode": "overlapped"},
  ),
  "parallel.pods >= 2": ({}, {"parallel.pods": 2}),
  "exchange.mode='overlapped' and parallel.stages=1": (
    {"parallel.pods": 2},
    {"parallel.pods": 2, "exchange.mode": "overlapped"},
  ),
  "exchange.mode='diloco'": ({"parallel.pods": 2}, {"parallel.pods": 2, "exchange.mode": "diloco"}),
  "moe.num_experts >= 1": ({}, {"moe.num_experts": 4}),
  "moe.dropless=False": ({"moe.num_experts": 4, "moe.dropless": True}, {"moe.num_experts": 4}),
  "model.family='llama'": ({}, {"model.family": "llama"}),
  "model.family='llama' or 'gemma'": ({}, {"model.family": "gemma"}),
  "model.family='gemma'": ({"model.family": "llama"}, {"model.family": "gemma"}),
  "model.rope_scaling='llama3'": (
    {"model.family": "llama"},
    {"model.family": "llama", "model.rope_scaling": "llama3"},
  ),
  "model.sliding_window >= 1": ({"model.family": "gemma"}, {"model.sliding_window": 16}),
  "backend.mode='remote'": ({}, {"backend.mode": "remote"}),
  "backend.mode='distributed'": ({}, {"backend.mode": "distributed"}),
  "backend.mode='remote' or 'distributed'": ({}, {"backend.mode": "remote"}),
  "backend.mode='embedded' or 'distributed'": ({"backend.mode": "remote"}, {}),
  "(backend.mode='remote' or 'distributed') or (fault.elastic=True)": (
    {},
    {"fault.elastic": True},
  ),
  "fault.elastic=True": ({}, {"fault.elastic": True}),
  "metrics.wandb_project set": ({}, {"metrics.wandb_project": "p"}),
  "serve.enabled=True and backend.mode='embedded'": ({}, {"serve.enabled": True}),
}


def _settings(rule):
  assert rule.needs in SETTINGS, f"no settings for the rule {rule.needs!r}: add them to SETTINGS"
  return SETTINGS[rule.needs]


def _other(value):
  """A value other than the default `value`, of its type."""
  if isinstance(value, bool):
    return not value
  if isinstance(value, int | float):
    return value + 1
  if isinstance(value, str):
    return "other"
  return (0, 1, 2)  # parallel.stage_boundaries


def _config(overrides):
  config = load_config("palm_tiny")
  config.unlock()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  return config


@pytest.mark.parametrize("rule", conditions.RULES, ids=lambda r: ",".join(r.keys))
def test_each_key_is_refused_where_it_is_not_read_and_taken_where_it_is(rule):
  default = defaults.get_config()
  off, on = _settings(rule)
  assert not rule.holds(_config(off)) and rule.holds(_config(on)), rule.needs
  for key in rule.keys:
    section, name = key.split(".")
    value = _other(default[section][name])
    with pytest.raises(ConfigError) as refused:
      conditions.check(_config({**off, key: value}), default, [rule])
    message = str(refused.value)
    assert message.startswith(f"{key}={value!r} has no effect: it is read only with {rule.needs}")
    assert "\n" not in message
    conditions.check(_config({**on, key: value}), default, [rule])


def test_every_key_the_rules_name_exists_and_the_shipped_configs_set_none_in_vain():
  default = defaults.get_config()
  for rule in conditions.RULES:
    for key in rule.keys:
      section, name = key.split(".")
      assert name in default[section], key
  for name in config_lib.shipped():
    config_lib.validate(load_config(name))


def test_files_without_the_files_dataset_is_refused_before_anything_is_written(tmp_path):
  """The case users met: data.files given, data.dataset left at the built-in corpus."""
  workdir = tmp_path / "run"
  config = small_config(**{"data.files": "my/*.txt"})
  with pytest.raises(ConfigError) as refused:
    train.run(config, str(workdir), show_progress=False)
  assert str(refused.value) == (
    "data.files='my/*.txt' has no effect: it is read only with data.dataset='files' (now "
    "data.dataset='pystdlib'); set that, or leave data.files at its default ('')"
  )
  assert not workdir.exists()


# Keys a training run reads only on an event, or that another command reads: where each is read.
READ_ELSEWHERE = {
  **{
    f"serve.{name}": "with serve.enabled, and by the serving command (python -m pwtrain.serve)"
    for name in (
      "host",
      "port",
      "max_batch",
      "max_len",
      "prefill_chunk",
      "queue_size",
      "reload",
      "reload_poll_s",
      "token_file",
    )
  },  # fmt: skip
  "train.resume": "when the workdir holds checkpoints (restore.finished)",
  "train.rollback_skip_batches": "when a rollback happens (train._roll_back)",
}
# Reads that are no use of a key: the whole config serialised (config.json, W&B), and
# validation itself (conditions.py, config.py).
_NOT_A_USE = ("to_dict",)


def _reads(monkeypatch):
  """The config keys ("section.key"; a key of a section not known: its name) read after
  `config.validate` passes, outside _NOT_A_USE: a spy on ml_collections' ConfigDict reads."""
  import sys

  import ml_collections

  reads, sections, on = set(), {}, [False]

  def use() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
      code = frame.f_code
      if code.co_name in _NOT_A_USE or code.co_filename.endswith(
        ("pwtrain/conditions.py", "pwtrain/config.py")
      ):
        return False
      frame = frame.f_back
    return True

  def spy(read):
    def spied(self, key):
      value = read(self, key)
      if on[0] and not key.startswith("_") and use():
        section = sections.get(id(self))
        reads.add(f"{section}.{key}" if section else key)
      return value

    return spied

  cls = ml_collections.ConfigDict
  monkeypatch.setattr(cls, "__getitem__", spy(cls.__getitem__))
  monkeypatch.setattr(cls, "__getattr__", spy(cls.__getattr__))
  validate = config_lib.validate

  def validated(config):
    validate(config)
    sections.update({id(config[s]): s for s in config.keys() if isinstance(config[s], cls)})
    on[0] = True

  monkeypatch.setattr(config_lib, "validate", validated)
  return reads, on


@pytest.mark.slow
def test_a_key_a_run_does_not_read_is_refused_where_it_is_set(tmp_path, monkeypatch):
  """Finds a missing rule, where the rules table cannot find it in itself: a real run records
  the config keys it reads (after validation); every key it does not read must, set away from
  its default on that config, be refused (by the rules table or validation), or be one read
  only elsewhere (READ_ELSEWHERE, each with where). A key the run neither reads nor refuses is
  ignored in silence: its rule is missing."""
  run = {"train.num_steps": 2}
  validate = config_lib.validate
  reads, on = _reads(monkeypatch)
  train.run(small_config(**run), str(tmp_path / "run"), show_progress=False)
  on[0] = False
  default = defaults.get_config()
  silent = []
  for section in default.keys():
    if not isinstance(default[section], type(default)):
      continue
    for name, value in default[section].items():
      key = f"{section}.{name}"
      if key in reads or name in reads or key in READ_ELSEWHERE:
        continue
      try:
        validate(small_config(**{**run, key: _other(value)}))
      except ValueError:  # ConfigError, or a library's refusal: refused where it is not read
        continue
      silent.append(key)
  assert not silent, f"read by no code path of this run and refused nowhere: {silent}"


# Keys that every run mode reads, but that act through a part each mode supplies: the read
# trace above sees such a key read wherever train.py reads it, also where the mode's part then
# ignores it (train.async_checkpoint did in remote and multi-island distributed runs, whose
# saves in parts went on asynchronously). So each such key is also set to its two values under
# each part that acts on it, and what it does must differ there; where it cannot, the key needs
# a rule. {key: (effect, {part: a context manager giving what `effect` needs under it})}, where
# `effect(tmp_path, value, given)` is what the key does at `value` (a hashable result).
def _commit_in_flight_after_save(tmp_path, value: bool, given) -> bool:
  """Whether `Checkpointer.save` of `given`'s state under its part writer (None: the state
  whole) returns with the save still in flight (not yet seen committed: its commit runs on while
  the steps go on)."""
  from pwtrain.checkpoint import Checkpointer

  part_writer, state = given
  directory = tmp_path / f"{value}-{getattr(part_writer, '__name__', 'whole')}"
  ckpt = Checkpointer(str(directory), keep=1, every=1, async_save=value, part_writer=part_writer)
  try:
    ckpt.save(1, state, {"pos": 1})
    in_flight = ckpt._in_flight is not None  # noqa: SLF001 - a save not yet seen finished
    # Finished before the next Checkpointer saves: two Orbax managers saving at once in one
    # process share its operation ids, and one then waits out Orbax's 300 s for a signal.
    ckpt.wait()
    return in_flight
  finally:
    ckpt.close()


@contextlib.contextmanager
def _local_state(part_writer):
  """`part_writer` and a state of this process's arrays."""
  import jax.numpy as jnp

  yield part_writer, {"w": jnp.zeros((64, 64), jnp.float32)}


@contextlib.contextmanager
def _remote_state():
  """Remote mode's part writer and a state of references to an array held by an island worker
  (a real worker process on loopback, which writes its part itself)."""
  import jax
  import numpy as np

  from pwtrain.backend.remote import launcher, saves
  from pwtrain.backend.remote.client import WorkerClient

  x = np.zeros((64, 64), np.float32)
  with launcher.launch([1]) as workers:
    client = WorkerClient(workers.addresses[0], workers.token)
    try:
      client.put_async("w", [x]).result()
      aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
      yield saves.PendingSave, {"w": saves.LeafRef(client, "w", 0, aval)}
    finally:
      client.close()


def _part_writers() -> dict:
  from pwtrain.checkpoint import ProcessParts

  return {
    "the state whole (embedded)": lambda: _local_state(None),
    "in parts, per process (distributed)": lambda: _local_state(ProcessParts),
    "in parts, per island worker (remote)": _remote_state,
  }


EFFECTS = {"train.async_checkpoint": (_commit_in_flight_after_save, _part_writers)}


@pytest.mark.parametrize(
  "key,part", [(k, p) for k, (_, parts) in EFFECTS.items() for p in parts()], ids=str
)
def test_a_key_each_mode_acts_on_with_its_own_part_changes_what_it_does_under_each(
  tmp_path, key, part
):
  effect, parts = EFFECTS[key]
  section, name = key.split(".")
  default = defaults.get_config()[section][name]
  with parts()[part]() as given:
    outcomes = {effect(tmp_path, value, given) for value in (default, _other(default))}
  assert len(outcomes) == 2, f"{key} does the same at either value with {part}: it needs a rule"
