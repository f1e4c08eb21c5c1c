"""Entry point: `python -m pwtrain.main --config=palm_tiny --workdir=/tmp/run`.

`--config` names a config that ships with pwtrain (pwtrain/configs/<name>.py), or gives the path
of a config file (`--config=configs/palm_tiny.py` in the repository, `--config=my_config.py`),
either optionally with `:arg` for its `get_config(arg)`.

Any config value can be overridden on the command line, e.g. `--config.train.num_steps=50`; a
key that does not exist is one line naming the closest that does. `--print_config` prints the
resolved config and exits.
"""

import atexit
import difflib
import logging as std_logging
import math
import os
import sys
import time
import traceback

from pwtrain import platforms

platforms.prepare()  # before JAX starts: whatever it can initialise (pwtrain/platforms.py)

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pwtrain import config as config_lib  # noqa: E402
from pwtrain import (  # noqa: E402
  console,  # noqa: E402
  dryrun,
  liveness,
  train,
  watch,
)
from pwtrain import workdir as workdir_lib  # noqa: E402
from pwtrain.backend import progress  # noqa: E402
from pwtrain.backend.faults import may_be_a_peers_death  # noqa: E402
from pwtrain.dryrun import compile as dryrun_compile  # noqa: E402
from pwtrain.errors import UserError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  str(config_lib.shipped()["palm_tiny"]),
  "A shipped config's name (pwtrain/configs/: palm_tiny, the default, ...) or a config file's "
  "path.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Checkpoints, metrics and traces (required to train; created if absent)."
)
_PROGRESS = flags.DEFINE_enum(
  "progress",
  "auto",
  ["auto", "bar", "lines", "none"],
  "How the console shows training: a tqdm bar, one plain line per train.log_every, nothing; "
  "auto: the bar on a terminal, else lines.",
)
_PRINT_CONFIG = flags.DEFINE_bool(
  "print_config", False, "Print the config after the command line's overrides, and exit."
)
_DRY_RUN = flags.DEFINE_bool(
  "dry_run",
  False,
  "Print the plan for the configured cluster and exit; uses no devices, writes nothing.",
)
_COMPILE = flags.DEFINE_bool(
  "compile",
  False,
  "With --dry_run: also compile the real step for the TPU topology hardware.topology on this "
  "host (needs the [tpu] extra) and report its compiled memory and FLOPs per island.",
)


def _connect_pathways() -> None:
  """Under Pathways on Cloud (JAX_PLATFORMS=proxy, JAX_BACKEND_TARGET=grpc://...), pathwaysutils
  registers the IFRT proxy backend before JAX starts; the run is then an ordinary embedded-mode
  client whose devices are the remote slices', carved into islands by slice
  (backend/cluster.py)."""
  if "proxy" not in os.environ.get("JAX_PLATFORMS", ""):
    return
  try:
    import pathwaysutils
  except ImportError:
    raise SystemExit(
      "JAX_PLATFORMS=proxy (Pathways on Cloud) needs pathwaysutils, which is not installed: "
      "pip install 'pwtrain[pathways]'"
    ) from None
  pathwaysutils.initialize()


def _join_distributed(config) -> None:
  """backend.mode='distributed': join the run's other processes on JAX's runtime before JAX
  starts (backend/distributed.py); a bad setting or an unreachable coordinator is one line. A
  process started by hand or by a scheduler (not pwtrain.launch) runs as a watched child of
  itself (pwtrain/watch.py), so that a dead peer is one line."""
  if config.backend.mode != "distributed":
    return
  from pwtrain.backend import distributed

  launched = "PWTRAIN_LAUNCHER_PID" in os.environ
  if not launched and not watch.watched():
    raise SystemExit(watch.run(sys.argv[1:]))
  distributed.die_with_parent()
  if not launched and not flags.FLAGS["verbosity"].present:
    console.drop_native_notices()  # this process's console is its own: no Gloo notices on it
  # A process silent for 3 heartbeats is lost: the run stops (the launcher or watch.py names
  # it), or with elastic pods the others go on without it (recoverable).
  try:
    config_lib.validate_backend(config)  # before joining: a bad fault.* key is one line here
    distributed.initialize(config.backend, _heartbeat_timeout_s(config), config.fault.elastic)
  except UserError as e:
    raise SystemExit(f"error: {e}") from None
  # Under pwtrain.launch a stopped process is killed; launcher or not, one whose computation
  # has run past fault.progress_timeout_s ends itself (wedged).
  # Before the islands are made: their schedulers record what runs where it is watched.
  timeout_s = config.fault.progress_timeout_s
  liveness.start(config.fault.heartbeat_s, timeout_s, progress.watch() if timeout_s else None)


def _heartbeat_timeout_s(config) -> int:
  """3 x fault.heartbeat_s in whole seconds: how long JAX's coordination service waits for a
  silent process before it takes it for dead."""
  return math.ceil(3 * config.fault.heartbeat_s)


def _verdict_wait_s(config) -> float:
  """How long a watched process whose step failed waits for JAX's verdict on a dead peer
  before it reports its own error: the heartbeat timeout, the service's staleness check (once a
  second) and a heartbeat period, twice over for a loaded machine. A peer's death ends it
  sooner; a runtime error of its own waits it out, and any other error (a bug of its own) does
  not wait at all (`may_be_a_peers_death`)."""
  return 2 * (_heartbeat_timeout_s(config) + 1.0 + config.fault.heartbeat_s)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    # Libraries stay quiet below WARNING (Orbax logs every save step at INFO, JAX each step of
    # joining a distributed run); pwtrain's own lines (resumed from, fell back to, workers'
    # logs, the closing summary) are shown.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("pwtrain").setLevel(std_logging.INFO)
  _connect_pathways()
  if not _DRY_RUN.value:
    _join_distributed(_CONFIG.value)
  if _COMPILE.value and not _DRY_RUN.value:
    raise app.UsageError("--compile is a kind of dry run: give --dry_run --compile")
  if _PRINT_CONFIG.value:
    print(_CONFIG.value)
    return
  if not _DRY_RUN.value and not _WORKDIR.value:
    raise SystemExit("error: --workdir is required: the directory for checkpoints and metrics")
  try:
    if _DRY_RUN.value:
      print(
        dryrun_compile.report(_CONFIG.value) if _COMPILE.value else dryrun.report(_CONFIG.value)
      )
      return
    if jax.process_index() == 0:
      std_logging.getLogger("pwtrain").info(platforms.describe())
    train.run(_CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)
    if _CONFIG.value.backend.mode == "distributed":
      _leave(_CONFIG.value)
  except BaseException as e:  # noqa: BLE001 - re-raised, or exits below
    distributed = _CONFIG.value.backend.mode == "distributed" and not _DRY_RUN.value
    if isinstance(e, UserError):
      e = SystemExit(f"error: {e}")  # a bad setting or file, named by pwtrain: one line
    if not distributed:
      if isinstance(e, SystemExit):
        raise e from None
      raise
    # A failed process exits at once: an orderly exit would wait for threads blocked on the
    # other processes and for jax.distributed's shutdown barrier, which they never reach.
    if not isinstance(e, SystemExit):
      if watch.watched() and may_be_a_peers_death(e):  # JAX ends this process once its
        time.sleep(_verdict_wait_s(_CONFIG.value))  # service names the dead peer
      traceback.print_exc()
    elif not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
    console.flush()
    sys.stderr.flush()
    os._exit(e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1)


def _leave(config) -> None:
  """Ends a distributed process whose run finished: it leaves the run in order, then exits 0
  without finalizing the interpreter.

  At finalization CPython ends every daemon thread that wants the GIL back with pthread_exit,
  whose forced unwind through jaxlib's C++ frames (nanobind's catch-all, noexcept) aborts the
  process: "terminate called after throwing an instance of ''", "FATAL: exception not
  rethrown", "Fatal Python error: Aborted". A distributed process has such threads at exit: its
  pull watchdog (backend/pulls.py) and the runtime's own threads that call back into Python, and
  one of them in a GIL-released call of JAX when finalization begins aborts a run that finished
  (on a loaded machine, now and then). So the exit handlers run here, in their order (JAX's
  shutdown barrier and the coordination service's shutdown among them; the console's and
  logging's flushes), and the process ends with os._exit(0), with no finalization to race."""
  from pwtrain.backend import distributed

  liveness.stop()
  if config.fault.elastic:
    from pwtrain.elastic import agreement

    agreement.end_of_run()  # a process started again and not yet rejoined leaves too
    distributed.leave()
  atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own handlers, in their order
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with `--config=<name>` naming a shipped config (config.resolve), and
  a mistake in it or in a `--config.<key>` override as one line (an unknown config lists the
  shipped ones; an unknown key names the closest that exists), not ml_collections' traceback."""
  try:
    argv = config_lib.resolve_argv(argv)
  except UserError as e:
    raise SystemExit(f"error: {e}") from None
  try:
    return flags.FLAGS(argv)
  except (KeyError, AttributeError, TypeError, ValueError, flags.Error) as e:
    raise SystemExit(f"error: {_explain(argv, e)}") from None


def _explain(argv: list[str], error: Exception) -> str:
  """The first `--config.<key>=` of `argv` that names no key of the config, with the closest
  keys; else the error's own first line."""
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if path is not None:
    try:
      keys = list(workdir_lib.flatten(config_lib.load(path).to_dict()))
    except Exception:  # noqa: BLE001 - the config itself is at fault: its own error below
      keys = None
    for arg in argv:
      if keys is not None and arg.startswith("--config.") and "=" in arg:
        key = arg.removeprefix("--config.").split("=", 1)[0]
        if key not in keys:
          what = (
            "section" if not any(k.startswith(key.split(".")[0] + ".") for k in keys) else "key"
          )
          close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
          hint = f"; did you mean {close[0]}?" if close else ""
          return f"unknown {what} {key}{hint}"
  lines = str(error).strip().strip("'\"").splitlines()
  return lines[0] if lines else type(error).__name__


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
