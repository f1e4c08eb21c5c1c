"""Distributed mode: this process joins JAX's own distributed runtime (`jax.distributed`).

Every process of a run calls `initialize` before JAX touches a device. Afterwards
`jax.devices()` lists every process's devices (sorted by process, then id), an island may hold
the devices of one process or of several, and a computation on an island runs on the processes
that own its devices (ordinary multi-controller SPMD within the island). Transfers between
islands on different processes are JAX's cross-host transfers (`jax.device_put` between
shardings on different processes, over the socket transport at
`jax_cross_host_transfer_socket_address`); collectives inside a multi-process CPU island use
gloo.

Where a process finds its place, first that is set wins:
  coordinator  backend.coordinator, $PWTRAIN_COORDINATOR
  processes    backend.num_processes, $PWTRAIN_NUM_PROCESSES
  process id   backend.process_id, $PWTRAIN_PROCESS_ID
and when none of the three is set anywhere, JAX's cluster auto-detection (SLURM, Open MPI,
GKE/Cloud TPU). The cross-host transfer socket listens on $PWTRAIN_TRANSFER_ADDRESS (the
launcher gives each process a port), else on this host at a free port.

What the processes then say to each other on the host (metrics, barriers, the step to stop
at) goes through the coordination service's key-value store: pwtrain/processes.py.
"""

import ctypes
import dataclasses
import os
import signal
import socket
import sys
import time

import jax

from pwtrain import processes
from pwtrain.errors import ConfigError

ENV = {
  "coordinator": "PWTRAIN_COORDINATOR",
  "num_processes": "PWTRAIN_NUM_PROCESSES",
  "process_id": "PWTRAIN_PROCESS_ID",
}
UNSET = {"coordinator": "", "num_processes": 0, "process_id": -1}  # the config's defaults
TRANSFER_ENV = "PWTRAIN_TRANSFER_ADDRESS"


@dataclasses.dataclass(frozen=True)
class Place:
  """Where this process stands in the run."""

  coordinator: str  # "" when found by JAX's cluster auto-detection
  num_processes: int
  process_id: int


def resolve(backend) -> Place | None:
  """This process's place from the config's `backend` section and the environment; None when
  neither says anything (JAX's cluster auto-detection decides). Raises ValueError naming the
  setting when one is malformed or out of range."""
  values = {}
  for key, env in ENV.items():
    value, setting = backend.get(key, UNSET[key]), f"backend.{key}"
    if value == UNSET[key]:
      value, setting = os.environ.get(env, ""), f"${env}"
      if value == "":
        continue
    values[key] = (value, setting)
  if not values:
    return None
  missing = [f"backend.{k} (or ${ENV[k]})" for k in ENV if k not in values]
  if missing:
    raise ConfigError(
      f"backend.mode='distributed' needs all of coordinator, num_processes and process_id "
      f"when any is given; missing {', '.join(missing)}"
    )
  coordinator, where = values["coordinator"]
  host, _, port = str(coordinator).rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError(f"{where}={coordinator!r} is not 'host:port' (process 0 serves it)")
  n, where_n = _integer(*values["num_processes"])
  i, where_i = _integer(*values["process_id"])
  if n < 1:
    raise ConfigError(f"{where_n}={n} must be >= 1")
  if not 0 <= i < n:
    raise ConfigError(
      f"{where_i}={i} is out of range: process ids are 0..{n - 1} for {n} processes"
    )
  return Place(str(coordinator), n, i)


def _integer(value, where: str) -> tuple[int, str]:
  try:
    return int(value), where
  except (TypeError, ValueError):
    raise ConfigError(f"{where}={value!r} is not an integer") from None


def initialize(backend, heartbeat_timeout_s: int | None = None, recoverable: bool = False) -> Place:
  """Joins the run's processes (blocks until all have joined, at most
  `backend.connect_timeout_s`); returns this process's place. Must run before JAX initialises
  a backend. A coordinator that cannot be reached is one clear error, not a wall of logs.

  `heartbeat_timeout_s`: how long JAX's coordination service waits for a silent process before
  it takes it for dead (None: JAX's default, 100 s); then JAX ends the others (the launcher or
  pwtrain/watch.py says which process died), unless `recoverable` (elastic pods): JAX's
  fault-tolerant runtime (`jax_enable_recoverability`), in which the others' live-nodes barrier
  (processes.agree) finds it gone and they go on without it."""
  place = resolve(backend)
  if recoverable:
    jax.config.update("jax_enable_recoverability", True)
  heartbeat = {}
  if heartbeat_timeout_s is not None:
    heartbeat = {"heartbeat_timeout_seconds": heartbeat_timeout_s}
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update(
    "jax_cross_host_transfer_socket_address", os.environ.get(TRANSFER_ENV) or _free_address()
  )
  timeout = int(backend.get("connect_timeout_s", 60))
  if place is not None and place.process_id != 0 and not _reachable(place.coordinator, timeout):
    # JAX's client aborts the whole process (a fatal C++ log) when registration times out, so
    # an absent coordinator is found here first.
    raise ConfigError(
      f"process {place.process_id} of {place.num_processes} could not join the run at "
      f"backend.coordinator={place.coordinator!r} within {timeout} s "
      f"(backend.connect_timeout_s): nothing answers there; is process 0 running?"
    )
  try:
    if place is None:
      jax.distributed.initialize(initialization_timeout=timeout, **heartbeat)
      place = Place("", jax.process_count(), jax.process_index())
    else:
      jax.distributed.initialize(
        place.coordinator,
        place.num_processes,
        place.process_id,
        initialization_timeout=timeout,
        **heartbeat,
      )
  except (RuntimeError, ValueError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if place is None:
      raise ConfigError(
        "backend.mode='distributed' found no cluster to join (JAX's auto-detection: "
        f"{first[:200]}): set backend.coordinator, backend.num_processes and "
        "backend.process_id, or start the run with python -m pwtrain.launch"
      ) from None
    raise ConfigError(
      f"process {place.process_id} of {place.num_processes} could not join the run at "
      f"backend.coordinator={place.coordinator!r} within {timeout} s "
      f"(backend.connect_timeout_s): is process 0 running there, and are all "
      f"{place.num_processes} processes started? ({first[:200]})"
    ) from None
  return place


def leave() -> None:
  """Leaves a run that joined with a heartbeat timeout (`initialize`), process 0 last. JAX's
  shutdown barrier then waits for no process, and process 0 serves the coordination service:
  a process whose shutdown reaches it after it has gone aborts. So every live process waits
  for the others to finish (JAX's live-nodes barrier, which leaves dead processes out), the
  others shut down, and process 0 waits until they have (the same barrier returns once they
  have left it) before it shuts down."""
  from jax._src import distributed as jax_distributed

  client = jax_distributed.global_state.client
  everyone = list(range(jax.process_count()))
  client.get_live_nodes(everyone)
  if jax.process_index() == 0:
    client.get_live_nodes(everyone)
  jax.distributed.shutdown()


def _reachable(address: str, timeout_s: float) -> bool:
  """Whether a TCP connection to `address` ("host:port") opens within `timeout_s`."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return True
    except OSError:
      if time.monotonic() > deadline:
        return False
      time.sleep(0.2)


def _free_address() -> str:
  return f"{socket.gethostname()}:{processes.free_port('')}"


def die_with_parent() -> None:
  """In a process `python -m pwtrain.launch` started, or one pwtrain/watch.py watches: ask Linux
  to SIGKILL it when that parent dies, so a parent killed without a chance to stop its
  processes (SIGKILL, a timeout) leaves no orphans behind holding the coordinator's port and the
  machine's cores."""
  launcher = os.environ.get("PWTRAIN_LAUNCHER_PID") or os.environ.get("PWTRAIN_WATCHER_PID")
  if not launcher or not sys.platform.startswith("linux"):
    return
  pr_set_pdeathsig = 1
  ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
  if os.getppid() != int(launcher):  # it died before the request took effect
    os._exit(1)
