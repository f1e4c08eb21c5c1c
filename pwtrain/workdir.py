"""The run's working directory: created and checked, locked for one run, and its config saved.

A run holds an exclusive `flock` on `<workdir>/.lock` for as long as it runs; the file names the
holder (pid and host). A second run on the same workdir fails at once with a line naming them.
The kernel drops the lock when its holder dies, however it dies, so a lock left by a dead
process (kill -9, a crash) is simply taken over by the next run: there is no stale state to
clean up. (flock is advisory and per host: runs on different hosts sharing a network filesystem
are not kept apart by it.)
"""

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import socket

from pwtrain.errors import ConfigError, WriteFailed

LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"


def prepare(workdir: str) -> str:
  """The absolute workdir, created if needed; a ValueError if it cannot be made or written."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir={workdir!r} cannot be created: {e}") from e
  if not os.access(workdir, os.W_OK):
    raise ConfigError(f"--workdir={workdir!r} is not writable")
  return workdir


class WorkdirLock:
  """An exclusive lock on a workdir, held from `acquire` until `release` (or process exit)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.workdir = workdir
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise ConfigError(
        f"--workdir={self.workdir} is in use by another run: {holder} (lock file {self.path}); "
        "wait for it to finish, stop it, or use another --workdir"
      ) from None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is not None:
      os.ftruncate(self._fd, 0)
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read_holder(fd: int) -> str:
  try:
    holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    return f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"
  except (ValueError, KeyError):
    return "a run that has not written its name yet"


def _now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def saved_config(workdir: str) -> tuple[str, dict | None]:
  """(path of `<workdir>/config.json`, the config dict it holds, or None if there is none)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return path, None
  with open(path) as f:
    return path, json.load(f)


# Keys that say where a run happens, not what it trains: a start elsewhere (other worker ports, a
# relaunched process's address) is no change of setting.
WHERE = ("backend.workers", "backend.coordinator", "backend.process_id")


def config_changes(workdir: str, config, start_step: int) -> list[str]:
  """The settings changed since the start whose record is `<workdir>/config.json`, one line per
  key ("optim.lr: 0.01 -> 0.02"), for a start resuming at `start_step` (none at step 0); the
  keys in WHERE do not count."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not start_step or not os.path.isfile(path):
    return []
  with open(path) as f:
    before = flatten(json.load(f))
  after = flatten(_resolved(config))
  changes = []
  for key in sorted((set(before) | set(after)) - set(WHERE)):
    if before.get(key, "(absent)") != after.get(key, "(absent)"):
      changes.append(f"{key}: {before.get(key, '(absent)')!r} -> {after.get(key, '(absent)')!r}")
  return changes


def save_config(workdir: str, config, start_step: int = 0) -> None:
  """Writes the resolved config as `<workdir>/config.json`, the record of what the run trains
  with (for `pwtrain.sample` and the next start's `config_changes`), and a copy as
  `config.<start step>.json`. The trainer writes it once the start's first step has trained, so
  a start that trains nothing leaves the record as it was."""
  now = _resolved(config)
  for target in (
    os.path.join(workdir, CONFIG_FILE),
    os.path.join(workdir, f"config.{start_step}.json"),
  ):
    tmp = f"{target}.tmp"
    try:
      with open(tmp, "w") as f:
        json.dump(now, f, indent=2, sort_keys=True)
        f.write("\n")
    except OSError as e:  # the storage refused it (a full disk): one line, the record unchanged
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise WriteFailed(target, e) from None
    os.replace(tmp, target)


def _resolved(config) -> dict:
  return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=repr))


def flatten(tree: dict, prefix: str = "") -> dict:
  """{"section.key": value} of a nested dict (a config's `to_dict()`)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def snapshot(workdir: str) -> set[str] | None:
  """Every path under `workdir` now, relative to it (None: it does not exist), for `undo`."""
  if not os.path.isdir(workdir):
    return None
  return _tree(workdir)


def undo(workdir: str, before: set[str] | None) -> None:
  """Removes what a refused start wrote under `workdir` since `snapshot` gave `before`: the
  whole directory if it did not exist, else every file and directory that was not there, at any
  depth (a new entry of the compilation cache as much as a new top-level directory); nothing
  that was there is touched, so a workdir holding a run keeps all of it."""
  if before is None:
    shutil.rmtree(workdir, ignore_errors=True)
    return
  if not os.path.isdir(workdir):
    return
  for path in sorted(_tree(workdir) - before, reverse=True):  # a directory after its contents
    full = os.path.join(workdir, path)
    if os.path.isdir(full) and not os.path.islink(full):
      shutil.rmtree(full, ignore_errors=True)
    elif os.path.lexists(full):
      os.remove(full)


def _tree(workdir: str) -> set[str]:
  paths = set()
  for root, dirs, files in os.walk(workdir):
    for name in dirs + files:
      paths.add(os.path.relpath(os.path.join(root, name), workdir))
  return paths
