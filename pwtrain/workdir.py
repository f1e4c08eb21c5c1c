"""The run's working directory: created and checked, locked for one run, and its config saved.

A run holds an exclusive `flock` on `<workdir>/.lock` for as long as it runs; the file names the
holder (pid and host). A second run on the same workdir fails at once with a line naming them.
The kernel drops the lock when its holder dies, however it dies, so a lock left by a dead
process (kill -9, a crash) is simply taken over by the next run: there is no stale state to
clean up. (flock is advisory and per host: runs on different hosts sharing a network filesystem
are not kept apart by it.)
"""

import datetime
import fcntl
import json
import os
import shutil
import socket

from pwtrain.errors import ConfigError

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


def save_config(workdir: str, config, start_step: int = 0) -> list[str]:
  """Writes the resolved config as `<workdir>/config.json`, what this start of the run uses
  (for `pwtrain.sample` and the record), and keeps a copy as `config.<start step>.json`. When
  the run resumes, the settings changed since the last start are returned, one line per key
  ("optim.lr: 0.01 -> 0.02"), and logged by the caller."""
  path = os.path.join(workdir, CONFIG_FILE)
  now = json.loads(json.dumps(config.to_dict(), sort_keys=True, default=repr))
  changes = []
  if start_step and os.path.isfile(path):
    with open(path) as f:
      before = flatten(json.load(f))
    after = flatten(now)
    for key in sorted(set(before) | set(after)):
      if before.get(key, "(absent)") != after.get(key, "(absent)"):
        changes.append(f"{key}: {before.get(key, '(absent)')!r} -> {after.get(key, '(absent)')!r}")
  for target in (path, os.path.join(workdir, f"config.{start_step}.json")):
    tmp = f"{target}.tmp"
    with open(tmp, "w") as f:
      json.dump(now, f, indent=2, sort_keys=True)
      f.write("\n")
    os.replace(tmp, target)
  return changes


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
  """The entries of `workdir` now (None: it does not exist), for `undo`."""
  return set(os.listdir(workdir)) if os.path.isdir(workdir) else None


def undo(workdir: str, before: set[str] | None) -> None:
  """Removes what a refused start wrote to `workdir` since `snapshot` gave `before`: the whole
  directory if it did not exist, else the entries that were not there (nothing else is
  touched, so a workdir holding a run keeps all of it)."""
  if before is None:
    shutil.rmtree(workdir, ignore_errors=True)
    return
  for name in set(os.listdir(workdir)) - before if os.path.isdir(workdir) else ():
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      os.remove(path)
