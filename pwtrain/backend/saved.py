"""Compiled pieces kept on disk under what built them, so that a warm start skips tracing.

JAX's persistent compilation cache spares XLA's compile, but a start still traces and lowers
every piece to learn the key it is cached under: for a small model that is most of what a warm
start spends building. `SavedExecutables` keeps each compiled piece (jax.experimental's
serialize_executable: the executable, its shardings and its argument and result trees) under a
key made of

  build_key  the caller's digest of everything that decides what its build traces (for
             pwtrain.harness: the config, pwtrain's source, the library versions, JAX's
             settings and XLA_FLAGS)
  and, per piece, its place in the build order, its name, its island's devices, its abstract
  arguments (shapes, dtypes, shardings), donated arguments and requested shardings.

A piece found there is loaded (on a compile thread) and never traced; one that is not is traced,
compiled and saved, unless JAX's persistent cache had its executable: an executable loaded from
that cache does not serialize whole again (on XLA:CPU its kernels are missing and the loaded copy
fails at its first run), so such a piece is left unsaved and traced at every start until a
compile of its own. A saved piece that no longer loads (a truncated file, another jaxlib) is
traced and compiled again, and replaced. A key's files are written whole (to a temporary name,
then renamed), so a reader sees a piece complete or not at all.
"""

import contextlib
import hashlib
import json
import logging
import os
import pickle
import tempfile
import threading
import zlib

import jax
from jax import monitoring
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

# Whether the compile running on this thread found its executable in JAX's persistent cache
# (jax.monitoring reports it on the compiling thread).
_compile = threading.local()


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _compile.cache_hit = True


monitoring.register_event_listener(_on_event)


def compile_lowered(lowered):
  """`lowered.compile()`, and whether XLA compiled it here (False: JAX's persistent cache had it,
  and it cannot be saved: the module doc)."""
  _compile.cache_hit = False
  compiled = lowered.compile()
  return compiled, not _compile.cache_hit


def digest(*parts) -> str:
  """A hex SHA-256 of the parts' reprs, in order."""
  h = hashlib.sha256()
  for part in parts:
    h.update(repr(part).encode())
    h.update(b"\0")
  return h.hexdigest()


def abstract(tree) -> tuple:
  """What a piece's key knows of its arguments: their tree, and each leaf's shape, dtype and
  sharding."""
  leaves, treedef = jax.tree.flatten(tree)
  return str(treedef), tuple(
    (getattr(x, "shape", None), str(getattr(x, "dtype", type(x))), repr(getattr(x, "sharding", 0)))
    for x in leaves
  )


class SavedExecutables:
  """The compiled pieces of one build (see the module doc), in `directory`."""

  def __init__(self, directory: str, build_key: str):
    self.directory = directory
    self.build_key = build_key
    self._count = 0
    self.loaded: list[str] = []  # keys of the pieces loaded (not traced)
    self.saved: list[str] = []  # keys of the pieces traced, compiled and saved
    self.from_cache: list[str] = []  # keys of the pieces JAX's cache had (traced, not saved)

  def key(self, *parts) -> str:
    """The next piece's key: the build's, the piece's place in the build order, and `parts`."""
    self._count += 1
    return digest(self.build_key, self._count, *parts)

  def num_outputs(self, key: str) -> int | None:
    """The saved piece's number of outputs, or None if none is saved under `key`."""
    try:
      return int(self._about(key)["num_outputs"])
    except (OSError, ValueError, KeyError):
      return None

  def load(self, key: str):
    """The saved piece as a jax.stages.Compiled, loaded onto the devices it was compiled for."""
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in self._about(key)["devices"]]
    with open(self._path(key, "bin"), "rb") as f:
      payload, in_tree, out_tree = pickle.loads(zlib.decompress(f.read()))
    compiled = serialize_executable.deserialize_and_load(
      payload, in_tree, out_tree, execution_devices=devices
    )
    self.loaded.append(key)
    return compiled

  def save(self, key: str, compiled, num_outputs: int, fresh: bool = True) -> None:
    """Keeps `compiled` under `key`, if XLA compiled it in this process (`fresh`, from
    `compile_lowered`); a piece that cannot be serialized is left unsaved."""
    if not fresh:
      self.from_cache.append(key)
      return
    try:
      blob = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
    except (ValueError, NotImplementedError, TypeError, pickle.PicklingError) as e:
      log.debug("%s: not saved (%s)", key, e)
      return
    try:
      os.makedirs(self.directory, exist_ok=True)
      self._write(self._path(key, "bin"), blob)
      devices = [d.id for d in compiled.runtime_executable().local_devices()]
      about = {"num_outputs": num_outputs, "devices": devices}
      self._write(self._path(key, "json"), json.dumps(about).encode())
      self.saved.append(key)
    except OSError as e:  # a full or read-only disk costs the next start its trace, no more
      log.warning("could not save a compiled piece in %s: %s", self.directory, e)

  def forget(self, key: str) -> None:
    """Removes the piece saved under `key` (one that did not load)."""
    for kind in ("json", "bin"):  # the marker first: a reader never finds half a piece
      with contextlib.suppress(OSError):
        os.remove(self._path(key, kind))

  def _about(self, key: str) -> dict:
    with open(self._path(key, "json")) as f:
      return json.load(f)

  def _path(self, key: str, kind: str) -> str:
    return os.path.join(self.directory, f"{key}.{kind}")

  def _write(self, path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(data)
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
