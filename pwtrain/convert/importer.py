"""`from_hf`: a Hugging Face checkpoint -> a pwtrain run at step 0 that any layout trains on.

The run's workdir gets:
  config.py      the run's config file: the defaults, the model keys read from config.json
                 (hf_config.py), the tokenizer's data keys, and the command line's --config.*
                 overrides (the training settings: data, optimizer, layout, ...)
  config.json    its record, as a run writes it (what `pwtrain.sample` reads)
  tokenizer/     the checkpoint's tokenizer.json and its companions (tokenizer_files.py)
  hf/config.json the checkpoint's own config.json, which `to_hf` starts from
  checkpoints/0  an ordinary Orbax checkpoint of the whole train state at step 0: the imported
                 parameters, the optimizer's initial state, and no data read yet
so that fine-tuning is an ordinary run: `python -m pwtrain.main --config=<workdir>/config.py
--workdir=<workdir>` resumes from step 0 with any layout.

Everything is checked before anything is written (every tensor's presence, shape and dtype from
the files' headers, the tokenizer against the model); a refused import leaves no workdir.
Streaming: each parameter is made on its devices with `jax.make_array_from_callback`, every
device's shard read straight from the safetensors file (names.Layout.read), so the host holds
one shard at a time besides what the devices hold.
"""

import ast
import json
import logging
import os

import jax
import numpy as np

from pwtrain import config as config_lib
from pwtrain import defaults, objectives, optim, restore
from pwtrain import step as step_lib
from pwtrain import workdir as workdir_lib
from pwtrain.checkpoint import Checkpointer
from pwtrain.checkpoint.integrity import path_name
from pwtrain.convert import hf_config, names, safetensors_io, tokenizer_files
from pwtrain.errors import ConfigError, DataError
from pwtrain.parallel import exchange as exchange_lib
from pwtrain.parallel.pipeline.state import train_state

log = logging.getLogger(__name__)

CONFIG_FILE = "config.py"
SOURCE_CONFIG = os.path.join("hf", "config.json")  # the checkpoint's own, for to_hf
# Tensors a checkpoint may hold that the model does not read: rope's cached frequencies.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Keys the command line may set although config.json sets them too.
OVERRIDABLE = ("model.param_dtype",)


def resolve_source(source: str) -> str:
  """A local checkpoint directory as it is; a Hub id ("owner/name") downloaded with
  huggingface_hub's snapshot_download (config, safetensors and tokenizer files only)."""
  if os.path.isdir(source):
    return os.path.abspath(source)
  if source.count("/") != 1 or source.startswith((".", "/", "~")):
    raise DataError(f"{source} is not a directory (nor a Hugging Face Hub id, 'owner/name')")
  try:
    from huggingface_hub import snapshot_download

    return snapshot_download(
      source,
      allow_patterns=["*.json", "*.safetensors"],
    )
  except ImportError:
    raise DataError("a Hub id needs huggingface_hub: pip install 'pwtrain[hf]'") from None
  except Exception as e:  # noqa: BLE001 - the Hub's client raises many kinds
    raise DataError(f"{source}: the Hub download failed ({str(e).splitlines()[0][:200]})") from None


def parse_overrides(args: list[str]) -> dict:
  """["--config.optim.lr=1e-5", ...] -> {"optim.lr": 1e-05, ...} (values as Python literals, or
  strings)."""
  out = {}
  for arg in args:
    if not arg.startswith("--config.") or "=" not in arg:
      raise ConfigError(f"{arg!r} is not a --config.<key>=<value> override")
    key, value = arg.removeprefix("--config.").split("=", 1)
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


def from_hf(source: str, workdir: str, overrides: dict | None = None) -> str:
  """Imports `source` (a directory or a Hub id) into `workdir`; returns the config file's path.
  A DataError or ConfigError (one line, naming the file and the key) leaves nothing written."""
  directory = resolve_source(source)
  hf_path = os.path.join(directory, "config.json")
  if not os.path.isfile(hf_path):
    raise DataError(f"{hf_path} is missing: give a Hugging Face checkpoint directory")
  with open(hf_path) as f:
    hf = json.load(f)
  keys = hf_config.model_keys(hf, hf_path)
  reader = safetensors_io.Reader(directory)
  keys.update(tokenizer_files.check(directory, hf, keys["model.vocab_size"]))
  workdir = os.path.abspath(os.path.expanduser(workdir))
  keys["data.tokenizer_path"] = os.path.join(workdir, tokenizer_files.RUN_DIR, "tokenizer.json")
  config = _config(keys, overrides or {})
  mesh = restore.reading_mesh(config)
  abstract, _ = restore.target(config, mesh)
  arch = hf_config.architecture_of(hf, hf_path)
  entries = _check_tensors(reader, config, abstract, arch, (hf_path, keys["model.param_dtype"]))
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ConfigError(f"--workdir={workdir} already holds a run's checkpoints: use a fresh one")

  before = workdir_lib.snapshot(workdir)
  try:
    workdir_lib.prepare(workdir)
    with workdir_lib.WorkdirLock(workdir):
      tokenizer_files.copy(directory, os.path.join(workdir, tokenizer_files.RUN_DIR))
      os.makedirs(os.path.join(workdir, "hf"), exist_ok=True)
      with open(os.path.join(workdir, SOURCE_CONFIG), "w") as f:
        json.dump(hf, f, indent=2)
      _write_checkpoint(config, workdir, reader, entries, abstract)
      path = os.path.join(workdir, CONFIG_FILE)
      _write_config_file(path, config, source)
      workdir_lib.save_config(workdir, config)
  except BaseException:
    workdir_lib.undo(workdir, before)
    raise
  finally:
    reader.close()
  return path


def _config(keys: dict, overrides: dict):
  """The defaults with the checkpoint's `keys`, then the command line's `overrides`."""
  clash = sorted(set(keys) & set(overrides) - set(OVERRIDABLE))
  if clash:
    raise ConfigError(
      f"--config.{clash[0]} is read from the checkpoint's config.json: it cannot be overridden "
      "(the weights have its shapes)"
    )
  config = defaults.get_config()
  for key, value in {**keys, **overrides}.items():
    section, _, name = key.partition(".")
    if section not in config or name not in config[section]:
      raise ConfigError(f"--config.{key}: no such key")
    try:
      config[section][name] = value
    except (TypeError, ValueError) as e:
      raise ConfigError(f"--config.{key}={value!r}: {e}") from None
  config_lib.validate(config)
  return config


def _check_tensors(reader, config, abstract, arch: str, declared: tuple) -> list:
  """The table's entries, once every tensor is in the files with the shape the model needs and
  the dtype config.json declares (`declared`: its path and dtype), and no tensor is one the
  model does not read."""
  params = abstract["pods"][0]["params"] if "pods" in abstract else abstract["params"]
  shapes = {path_name(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  entries = names.table(config.model)
  for entry in entries:
    if entry.hf not in reader.names:
      raise DataError(
        f"{reader.directory}: tensor {entry.hf} is missing; a {arch} of this config.json has it"
      )
    want = entry.layout.hf_shape(shapes[entry.path])
    if reader.shape(entry.hf) != want:
      raise DataError(
        f"{reader.file_of(entry.hf)}: {entry.hf} has shape {list(reader.shape(entry.hf))}, "
        f"config.json makes it {list(want)}"
      )
    if reader.dtype(entry.hf) != declared[1]:
      raise DataError(
        f"{reader.file_of(entry.hf)}: {entry.hf} has dtype {reader.raw_dtype(entry.hf)}, but "
        f"{declared[0]} declares torch_dtype={declared[1]!r}; supported: "
        f"{', '.join(safetensors_io.DTYPES)}, one for the whole checkpoint"
      )
  known = {e.hf for e in entries}
  tied = "unembedding" not in shapes
  for name in reader.names:
    ignored = name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")
    if name not in known and not ignored:
      raise DataError(
        f"{reader.file_of(name)}: tensor {name} is not part of a {arch} that pwtrain reads "
        f"(supported: {', '.join(hf_config.ARCHITECTURES)})"
      )
  return entries


def _write_checkpoint(config, workdir: str, reader, entries, abstract) -> None:
  """The step-0 train state, its parameters read shard by shard onto their devices."""
  one = abstract["pods"][0] if "pods" in abstract else abstract
  flat, treedef = jax.tree_util.tree_flatten_with_path(one["params"])
  by_path = {e.path: e for e in entries}
  arrays = []
  for path, leaf in flat:
    entry = by_path[path_name(path)]
    arrays.append(_array(reader, entry, leaf))
  params = jax.tree.unflatten(treedef, arrays)
  tx, _ = optim.build(config.optim, config.train.num_steps)
  exchange = exchange_lib.make(config)
  fns = step_lib.model_fns(config.model, config.moe)
  shardings = jax.tree.map(lambda leaf: leaf.sharding, one)
  del shardings["params"]

  def rest(params):  # everything but the parameters, which stay the arrays read (no copy)
    reference = objectives.holds_reference(config)  # a copy of the imported params
    state = train_state(fns, tx, config.seed, exchange, params=params, reference=reference)
    return {k: v for k, v in state.items() if k != "params"}

  state = {**jax.jit(rest, out_shardings=shardings)(params), "params": params}
  if "pods" in abstract:
    state = {"pods": [state] * config.parallel.pods}
  ckpt = Checkpointer(
    os.path.join(workdir, "checkpoints"),
    keep=config.train.keep_checkpoints,
    every=1,
    async_save=False,
  )
  try:
    ckpt.save(0, state, {})  # {}: no data read yet (data/loader.py)
    ckpt.wait()
  finally:
    ckpt.close()


def _array(reader, entry, leaf) -> jax.Array:
  """One parameter on its devices, each device's shard read from the file (and cast to the
  parameter's dtype)."""

  def shard(index):
    block = entry.layout.read(leaf.shape, index, lambda slices: reader.read(entry.hf, slices))
    return np.asarray(block).astype(leaf.dtype)

  return jax.make_array_from_callback(leaf.shape, leaf.sharding, shard, dtype=leaf.dtype)


def _write_config_file(path: str, config, source: str) -> None:
  """config.py: every key that differs from the defaults, as a config file sets it."""
  default = workdir_lib.flatten(defaults.get_config().to_dict())
  now = workdir_lib.flatten(config.to_dict())
  lines = [f"  c.{key} = {value!r}" for key, value in now.items() if default.get(key) != value]
  text = [
    f'"""{source} imported by `python -m pwtrain.convert from_hf` (docs/models.md).',
    "",
    "Fine-tune it (any --config.<key>=<value> overrides as for any run):",
    f"  python -m pwtrain.main --config={path} --workdir={os.path.dirname(path)}",
    '"""',
    "",
    "from pwtrain import defaults",
    "",
    "",
    "def get_config(arg=None):",
    "  del arg",
    "  c = defaults.get_config()",
    *lines,
    "  return c",
  ]
  with open(path, "w") as f:
    f.write("\n".join(text) + "\n")
