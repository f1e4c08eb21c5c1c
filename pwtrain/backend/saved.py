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

A build loads every piece or traces every piece: pieces may depend on what tracing an earlier
one recorded (a pipeline stage's B reads the VJP structure its F's trace left), so a build never
mixes the two. A traced build saves each piece XLA compiled in this process and, if it saved
them all, marks the build complete; a later build of the same key then loads every piece (on
compile threads) and traces none. A piece JAX's persistent cache had is not saved: an executable
loaded from that cache does not serialize whole again (on XLA:CPU its kernels are missing and
the copy fails at its first run), so that build stays unmarked and is traced at every start
until one compiles all of its pieces itself. A loading build that finds a piece missing or
unloadable (`NotSaved`) is discarded by its caller and traced instead (Harness.build). Files are
written whole (to a temporary name, then renamed), the build's mark last.
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


class NotSaved(Exception):
  """A loading build met a piece it has no whole saved copy of (see the module doc)."""


class SavedExecutables:
  """The compiled pieces of one build (see the module doc), in `directory`: `loading` if the
  build was marked complete, else traced and saved."""

  def __init__(self, directory: str, build_key: str):
    self.directory = directory
    self.build_key = build_key
    self._count = 0
    self._lock = threading.Lock()
    self.loading = os.path.isfile(self._path(build_key, "build"))
    self.loaded: list[str] = []  # keys of the pieces loaded (not traced)
    self.saved: list[str] = []  # keys of the pieces traced, compiled and saved
    self.from_cache: list[str] = []  # keys of the pieces JAX's cache had (traced, not saved)

  def key(self, *parts) -> str:
    """The next piece's key: the build's, the piece's place in the build order, and `parts`."""
    self._count += 1
    return digest(self.build_key, self._count, *parts)

  def num_outputs(self, key: str) -> int:
    """The saved piece's number of outputs (loading); NotSaved if it has none."""
    try:
      return int(self._about(key)["num_outputs"])
    except (OSError, ValueError, KeyError) as e:
      raise NotSaved(f"piece {key[:12]}: {e}") from e

  def load(self, key: str):
    """The saved piece as a jax.stages.Compiled, loaded onto the devices it was compiled for;
    NotSaved if it does not load."""
    try:
      by_id = {d.id: d for d in jax.devices()}
      devices = [by_id[i] for i in self._about(key)["devices"]]
      with open(self._path(key, "bin"), "rb") as f:
        payload, in_tree, out_tree = pickle.loads(zlib.decompress(f.read()))
      compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=devices
      )
    except Exception as e:  # noqa: BLE001 - any unloadable file: the build is traced instead
      raise NotSaved(f"piece {key[:12]}: {type(e).__name__}: {e}") from e
    with self._lock:
      self.loaded.append(key)
    return compiled

  def save(self, key: str, compiled, num_outputs: int, fresh: bool) -> None:
    """Keeps `compiled` under `key`, if XLA compiled it in this process (`fresh`, from
    `compile_lowered`). Never raises: a piece that cannot be serialized or written is left
    unsaved (and the build unmarked)."""
    if not fresh:
      with self._lock:
        self.from_cache.append(key)
      return
    try:
      blob = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
      os.makedirs(self.directory, exist_ok=True)
      self._write(self._path(key, "bin"), blob)
      devices = [d.id for d in compiled.runtime_executable().local_devices()]
      about = {"num_outputs": num_outputs, "devices": devices}
      self._write(self._path(key, "json"), json.dumps(about).encode())
    except Exception as e:  # noqa: BLE001 - saving never fails a compile
      log.warning("could not save a compiled piece in %s: %s", self.directory, e)
      return
    with self._lock:
      self.saved.append(key)

  def finish(self) -> None:
    """After a traced build's compiles: marks it complete if every piece was saved."""
    if not self.loading and self._count and len(self.saved) == self._count:
      with contextlib.suppress(OSError):
        self._write(self._path(self.build_key, "build"), b"")

  def discard(self) -> "SavedExecutables":
    """After a loading build failed (NotSaved): unmarks it; a fresh one to trace it with."""
    with contextlib.suppress(OSError):
      os.remove(self._path(self.build_key, "build"))
    return SavedExecutables(self.directory, self.build_key)

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
