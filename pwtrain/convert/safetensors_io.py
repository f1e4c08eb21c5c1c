"""Safetensors checkpoints read and written one tensor at a time.

`Reader` opens a directory's `model.safetensors`, or the shards `model.safetensors.index.json`
lists, lazily (safetensors' `safe_open`): a tensor's shape and dtype come from the file's header,
and `read(name, slices)` reads just that block of it (`get_slice`), so an import takes each
device's shard straight from the file and never holds a whole model.

`write_shards` writes tensors whose shapes and dtypes are known beforehand into files of at most
`shard_size` bytes (one tensor larger than that gets a file of its own): each file's header is
written first, then each tensor's bytes as `fetch(name)` gives them, one tensor in memory at a
time; with more than one file, `model.safetensors.index.json` maps each tensor to its file, as
transformers writes them.
"""

import json
import os
import struct

import jax.numpy as jnp
import numpy as np

from pwtrain.errors import DataError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors' dtype names <-> numpy's (bfloat16 is ml_dtypes', which numpy arrays of JAX use).
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
CODES = {v: k for k, v in DTYPES.items()}


class Reader:
  """The tensors of a Hugging Face checkpoint directory: `names`, `file_of(name)`,
  `shape(name)`, `dtype(name)` (numpy's name: "float32", "bfloat16", ...; None for a dtype a
  model cannot hold), `read(name, slices)`."""

  def __init__(self, directory: str):
    from safetensors import safe_open

    self.directory = directory
    index_path, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
    if os.path.isfile(index_path):
      with open(index_path) as f:
        try:
          weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
          raise DataError(f"{index_path}: not a safetensors index (no 'weight_map': {e})") from e
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
      weight_map, files = None, [SINGLE]
    else:
      raise DataError(
        f"{directory} has neither {SINGLE} nor {INDEX}: give a Hugging Face checkpoint directory "
        "with safetensors weights (PyTorch .bin files are not read)"
      )
    self._files, self._headers = {}, {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise DataError(f"{path} is missing: {INDEX} lists it; download the whole checkpoint")
      try:
        self._files[name] = safe_open(path, framework="numpy")
      except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise DataError(f"{path} is not a safetensors file ({str(e)[:200]})") from None
      self._headers[name] = _header(path)
    found = {t: n for n, header in self._headers.items() for t in header}
    if weight_map is not None:
      for tensor, name in weight_map.items():
        if found.get(tensor) != name:
          raise DataError(f"{index_path} places {tensor} in {name}, whose header does not hold it")
    self._where = found

  @property
  def names(self) -> list[str]:
    return sorted(self._where)

  def file_of(self, name: str) -> str:
    return os.path.join(self.directory, self._where[name])

  def shape(self, name: str) -> tuple:
    return tuple(self._headers[self._where[name]][name]["shape"])

  def dtype(self, name: str) -> str | None:
    return DTYPES.get(self._headers[self._where[name]][name]["dtype"])

  def raw_dtype(self, name: str) -> str:
    return self._headers[self._where[name]][name]["dtype"]

  def read(self, name: str, slices: tuple) -> np.ndarray:
    """The block `slices` (one slice per dim) of tensor `name`."""
    return self._files[self._where[name]].get_slice(name)[slices]

  def close(self) -> None:
    self._files.clear()


def _header(path: str) -> dict:
  """{tensor: {"dtype", "shape", "data_offsets"}} of a safetensors file (its JSON header)."""
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
  header.pop("__metadata__", None)
  return header


def plan_shards(tensors: list[tuple[str, tuple, str]], shard_size: int) -> list[list]:
  """[(name, shape, dtype)] in order -> consecutive groups of at most `shard_size` bytes."""
  shards, size = [[]], 0
  for tensor in tensors:
    n = _nbytes(tensor)
    if shards[-1] and size + n > shard_size:
      shards.append([])
      size = 0
    shards[-1].append(tensor)
    size += n
  return shards


def _nbytes(tensor) -> int:
  _, shape, dtype = tensor
  return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize


def write_shards(directory: str, tensors: list[tuple[str, tuple, str]], fetch, shard_size: int):
  """Writes `tensors` [(name, shape, dtype)] in that order, `fetch(name)` giving each one's
  numpy array; returns the files written."""
  shards = plan_shards(tensors, shard_size)
  names = (
    [SINGLE]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  weight_map = {}
  for name, shard in zip(names, shards, strict=True):
    _write_file(os.path.join(directory, name), shard, fetch)
    weight_map.update({tensor: name for tensor, _, _ in shard})
  if len(shards) > 1:
    total = sum(_nbytes(t) for t in tensors)
    with open(os.path.join(directory, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
      f.write("\n")
  return names


def _write_file(path: str, tensors: list, fetch) -> None:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, dtype in tensors:
    n = _nbytes((name, shape, dtype))
    span = [offset, offset + n]
    header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": span}
    offset += n
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for name, shape, dtype in tensors:
      array = np.ascontiguousarray(fetch(name))
      if array.shape != tuple(shape) or array.dtype != jnp.dtype(dtype):
        raise AssertionError(f"{name}: got {array.shape} {array.dtype}, planned {shape} {dtype}")
      f.write(array.reshape(-1).view(np.uint8).data)
      del array
