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

Nothing read from the directory runs unless this user's pwtrain wrote it. A saved executable is
native code, and JAX's serialized form of one is a pickle (jax.experimental.serialize_executable:
"not safe to call with untrusted inputs"), while a workdir or cache may be shared. So each piece's
files carry an HMAC-SHA256 of everything loaded from them (the executable's bytes, its argument
and result trees, its devices, its output count), keyed by a secret that never lives in the
directory (`key_file()`: one per user, made on first use, readable by its owner only); a piece
whose MAC does not match is refused before any of it is unpickled or loaded, and the build is
traced instead. (Storing the trees as data would not be enough: JAX's executable payload is a
pickle itself, and its machine code runs when called. Trees with integer dict keys and optax's
named tuples do not fit PyTreeDef's proto form either.)

`evict` keeps the whole compilation cache (JAX's entries and these pieces) within a cap
(train.compile_cache_max_bytes): JAX evicts its own entries least recently used first (its
`jax_compilation_cache_max_size`), and the saved builds here, least recently built or loaded
first, go before any of JAX's.
"""

import contextlib
import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
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
    NotSaved if it does not load, or if its MAC does not match (it is then never unpickled)."""
    try:
      about = self._about(key)
      with open(self._path(key, "bin"), "rb") as f:
        blob = f.read()
      if not hmac.compare_digest(about["mac"], _mac(blob, about)):
        raise NotSaved(
          f"piece {key[:12]}: its MAC does not match (not written by this user's pwtrain, or "
          f"changed since): refused unread (key {key_file()})"
        )
      by_id = {d.id: d for d in jax.devices()}
      devices = [by_id[i] for i in about["devices"]]
      payload, in_tree, out_tree = pickle.loads(zlib.decompress(blob))  # its MAC matched
      compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=devices
      )
    except NotSaved:
      raise
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
      about = {
        "num_outputs": num_outputs,
        "devices": [d.id for d in compiled.runtime_executable().local_devices()],
      }
      about["mac"] = _mac(blob, about)
      os.makedirs(self.directory, exist_ok=True)
      self._write(self._path(key, "bin"), blob)
      self._write(self._path(key, "json"), json.dumps(about).encode())
    except Exception as e:  # noqa: BLE001 - saving never fails a compile
      log.warning("could not save a compiled piece in %s: %s", self.directory, e)
      return
    with self._lock:
      self.saved.append(key)

  def finish(self) -> None:
    """After a build's compiles: a traced build is marked complete if every piece was saved; a
    loaded one's mark is touched (it was used: `evict` keeps it longest)."""
    mark = self._path(self.build_key, "build")
    with contextlib.suppress(OSError):
      if self.loading:
        os.utime(mark)
      elif self._count and len(self.saved) == self._count:
        self._write(mark, b"")

  def discard(self) -> "SavedExecutables":
    """After a loading build failed (NotSaved): unmarks it; a fresh one to trace it with."""
    with contextlib.suppress(OSError):
      os.remove(self._path(self.build_key, "build"))
    return SavedExecutables(self.directory, self.build_key)

  def _about(self, key: str) -> dict:
    with open(self._path(key, "json")) as f:
      return json.load(f)

  def _path(self, key: str, kind: str) -> str:
    """A piece's files are named by their build's key, so `evict` removes a build whole."""
    name = f"{key}.{kind}" if key == self.build_key else f"{self.build_key}.{key}.{kind}"
    return os.path.join(self.directory, name)

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


def key_file() -> str:
  """The file of this user's key for the pieces' MACs: $PWTRAIN_PIECES_KEY, else
  pwtrain/pieces.key under $XDG_CACHE_HOME (~/.cache): outside any workdir or shared cache."""
  if os.environ.get("PWTRAIN_PIECES_KEY"):
    return os.environ["PWTRAIN_PIECES_KEY"]
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "pwtrain", "pieces.key")


_key_lock = threading.Lock()


def _key() -> bytes:
  """This user's key (`key_file`), made on first use: 32 random bytes, mode 0600."""
  path = key_file()
  with _key_lock:
    if not os.path.exists(path):
      os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
      fd = os.open(f"{path}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
      with contextlib.suppress(FileExistsError):  # another process made it first: theirs
        os.link(f"{path}.{os.getpid()}", path)
      os.remove(f"{path}.{os.getpid()}")
    with open(path, "rb") as f:
      return f.read()


def _mac(blob: bytes, about: dict) -> str:
  """HMAC-SHA256, under this user's key, of a piece's bytes and of what its json says."""
  fields = {k: v for k, v in about.items() if k != "mac"}
  message = hashlib.sha256(blob).digest() + json.dumps(fields, sort_keys=True).encode()
  return hmac.new(_key(), message, hashlib.sha256).hexdigest()


def evict(directory: str, cache_dir: str, max_bytes: int) -> list[str]:
  """Removes the saved builds in `directory` (pieces) least recently built or loaded first
  (their marks' modification time; an unmarked build counts as oldest) until everything under
  `cache_dir` (JAX's entries and the pieces) takes at most `max_bytes`; the build keys removed.
  JAX's own entries are left to JAX's eviction (module doc)."""
  if not os.path.isdir(directory):
    return []
  total = sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(cache_dir)
    for name in names
  )
  builds: dict[str, list[str]] = {}
  for name in os.listdir(directory):
    if name.startswith("."):  # a file being written
      continue
    builds.setdefault(name.split(".")[0], []).append(os.path.join(directory, name))

  def last_used(build: str) -> float:
    mark = os.path.join(directory, f"{build}.build")
    return os.path.getmtime(mark) if os.path.exists(mark) else 0.0

  removed = []
  for build in sorted(builds, key=last_used):
    if total <= max_bytes:
      break
    for path in sorted(builds[build], key=lambda p: p.endswith(".build"), reverse=True):
      with contextlib.suppress(OSError):  # the mark first: a half-removed build never loads
        size = os.path.getsize(path)
        os.remove(path)
        total -= size
    removed.append(build)
  return removed
