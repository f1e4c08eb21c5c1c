"""`to_hf`: a pwtrain run's checkpoint -> a Hugging Face directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

It writes config.json (hf_config.to_hf: the imported checkpoint's own, its keys put back),
model.safetensors (or shards of at most `shard_size` bytes with model.safetensors.index.json),
generation_config.json and the tokenizer's files (those the import brought, or the run's
data.tokenizer_path as tokenizer.json).

Streaming: the checkpoint is read one parameter at a time (Orbax's partial restore of that one
array, onto one device), checked against its fingerprint in the checkpoint's integrity record,
laid out as Hugging Face's tensor (names.py) and written at its place in its file, whose header
was written first (safetensors_io.write_shards): the host holds one tensor at a time. Files are
written into a temporary directory beside the target and moved into place at the end, so a
failed export leaves no half-written checkpoint.
"""

import json
import os
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from pwtrain import restore
from pwtrain.checkpoint import Checkpointer
from pwtrain.checkpoint.integrity import fingerprint, path_name
from pwtrain.convert import hf_config, importer, names, safetensors_io, tokenizer_files
from pwtrain.errors import ConfigError, DataError
from pwtrain.models import moe as moe_lib

EXPORTS = ("llama", "gemma")


def check_exportable(config) -> None:
  """A ConfigError naming what cannot be exported (a PaLM or an MoE model)."""
  if config.model.family not in EXPORTS:
    raise ConfigError(
      f"model.family={config.model.family!r} has no Hugging Face architecture: to_hf exports "
      f"the families {' and '.join(repr(f) for f in EXPORTS)}"
    )
  if moe_lib.enabled(config.moe):
    raise ConfigError(
      f"moe.num_experts={config.moe.num_experts}: the Hugging Face architectures to_hf writes "
      "(hf_config.ARCHITECTURES) have no MoE layers"
    )


def to_hf(config, workdir: str, out_dir: str, *, shard_size: int, step: int | None = None):
  """Exports `workdir`'s checkpoint (the latest, or `step`) of a run of `config` to `out_dir`
  (which must not exist, or be empty); returns the safetensors files written."""
  check_exportable(config)
  source_path = os.path.join(workdir, importer.SOURCE_CONFIG)
  source = None
  if os.path.isfile(source_path):
    source = hf_config.read_json(source_path)
  hf = hf_config.to_hf(config.model, source)
  out_dir = os.path.abspath(os.path.expanduser(out_dir))
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise ConfigError(f"{out_dir} exists and is not empty: give a new directory")
  directory = os.path.join(workdir, "checkpoints")
  step = _step(directory, step)
  item = os.path.join(directory, str(step), "state")
  if not os.path.isdir(item):
    raise DataError(
      f"{os.path.join(directory, str(step))} was written in parts by island workers (remote "
      "mode): restore it in an embedded run and checkpoint it, then export that"
    )
  abstract, _ = restore.target(config, restore.reading_mesh(config, jax.devices()[:1]))
  prefix = "pods/0/" if "pods" in abstract else ""
  params = abstract["pods"][0]["params"] if prefix else abstract["params"]
  leaves = {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  saved = _saved_leaves(item)
  entries = names.table(config.model)
  for entry in entries:
    key = f"{prefix}params/{entry.path}"
    want = (tuple(leaves[entry.path].shape), leaves[entry.path].dtype.name)
    if saved.get(key) != want:
      raise DataError(
        f"{item}: {key} is {saved.get(key, 'missing')}, the run's config makes it {want}: "
        "pass the config the run was trained with"
      )
  fingerprints = _fingerprint_record(os.path.join(directory, str(step)))
  tensors = [
    (e.hf, e.layout.hf_shape(leaves[e.path].shape), leaves[e.path].dtype.name) for e in entries
  ]
  by_hf = {e.hf: e for e in entries}
  handler = ocp.PyTreeCheckpointHandler()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def fetch(name: str) -> np.ndarray:
    entry = by_hf[name]
    return entry.layout.to_hf(_read_one(handler, item, prefix, entry, leaves, device, fingerprints))

  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.partial")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    files = safetensors_io.write_shards(tmp, tensors, fetch, shard_size)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf, f, indent=2, sort_keys=True)
    _tokenizer(config, workdir, tmp, hf)
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return files


def _step(directory: str, step: int | None) -> int:
  if not os.path.isdir(directory):
    raise ConfigError(f"{directory} does not exist: is --workdir a pwtrain run's?")
  reader = Checkpointer(directory, keep=1, every=1, async_save=False, read_only=True)
  try:
    steps = reader.all_steps()
  finally:
    reader.close()
  if not steps:
    raise ConfigError(f"{directory} holds no checkpoint")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ConfigError(f"--step={step}: {directory} holds steps {steps}")
  return step


def _saved_leaves(item: str) -> dict:
  """{array path: (shape, dtype name)} of a checkpoint's state item, from its metadata."""
  tree = ocp.PyTreeCheckpointHandler().metadata(pathlib.Path(item)).tree
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(p): (tuple(m.shape), np.dtype(m.dtype).name) for p, m in flat}


def _fingerprint_record(step_dir: str) -> dict | None:
  """{array path: fingerprint} the checkpoint recorded when it was saved (None: none)."""
  path = os.path.join(step_dir, "integrity")
  if not os.path.isdir(path):
    return None
  return ocp.JsonCheckpointHandler().restore(pathlib.Path(path))["fingerprint"]


def _read_one(handler, item, prefix, entry, leaves, device, fingerprints) -> np.ndarray:
  """One parameter read alone from the checkpoint (onto `device`), checked against its
  recorded fingerprint."""
  leaf = leaves[entry.path]
  target = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)
  tree = target
  for key in reversed(f"{prefix}params/{entry.path}".split("/")):
    tree = {key: tree}
  if prefix:
    tree = {"pods": [tree["pods"]["0"]]}
  args = jax.tree.map(
    lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), tree
  )
  restored = handler.restore(
    pathlib.Path(item),
    args=ocp.args.PyTreeRestore(item=tree, restore_args=args, partial_restore=True),
  )
  key = f"{prefix}params/{entry.path}"
  if fingerprints is not None and fingerprint(restored) != {key: fingerprints.get(key)}:
    raise DataError(f"{item}: {key} does not match its fingerprint: the checkpoint is damaged")
  return np.asarray(jax.tree.leaves(restored)[0])


def _tokenizer(config, workdir: str, out_dir: str, hf: dict) -> None:
  """The run's tokenizer files (an imported model's), or its data.tokenizer_path as
  tokenizer.json; generation_config.json from the import, else from config.json's ids."""
  run_dir = os.path.join(workdir, tokenizer_files.RUN_DIR)
  copied = tokenizer_files.copy(run_dir, out_dir) if os.path.isdir(run_dir) else []
  if tokenizer_files.TOKENIZER not in copied and config.data.tokenizer == "huggingface":
    shutil.copyfile(config.data.tokenizer_path, os.path.join(out_dir, tokenizer_files.TOKENIZER))
  if "generation_config.json" not in copied:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump(tokenizer_files.generation_config(hf), f, indent=2)
