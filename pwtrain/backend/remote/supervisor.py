"""Remote mode's supervisor: starts the island workers if asked, and survives losing one.

A lost worker (dead, silent for 3 heartbeats, or wedged: client.Monitor) fails the step in
flight with `WorkerLost`; a worker this process launched that is declared lost alive (stopped,
wedged) is SIGKILLed then (Monitor.declare). With `fault.elastic` the run carries on without the
worker's pod (pwtrain/elastic/), and the supervisor relaunches a worker it launched as soon as
its process has exited, on its old port, so that the pod rejoins. Otherwise, or when too few
pods are left, with `fault.max_restarts > 0` the supervisor restarts the workers it launched (on
their old ports), or waits for externally started ones to answer again and resets them, and runs
the job again: it resumes from the last committed checkpoint, so at most the steps since then
are lost.
"""

import copy
import logging
import os
import threading
import time

from pwtrain import processes
from pwtrain.backend.remote import auth, launcher
from pwtrain.backend.remote.client import WorkerLost

log = logging.getLogger(__name__)


def run_remote(config, run_once, island_sizes: list[int], workdir: str):
  """`run_once(config)` with workers launched/restarted as the config says;
  `island_sizes` are the devices of each island (the plan's), for workers it launches, whose
  logs go to <workdir>/workers."""
  config = copy.deepcopy(config)  # backend.workers is filled in for launched workers
  workers = None
  if config.backend.launch_workers:
    token = os.environ.get(config.backend.token_env) or None
    workers = launcher.launch(
      list(island_sizes),
      token=token,
      env=_compile_cache_env(),
      log_dir=os.path.join(workdir, "workers"),
    )
    os.environ[config.backend.token_env] = workers.token  # where make_cluster reads it
    config.backend.token_file = ""
    config.backend.workers = tuple(workers.addresses)
    log.info(
      "launched %d island workers: %s (logs in %s)",
      len(island_sizes),
      workers.addresses,
      workers.log_dir,
    )
  restarts = 0
  stop_relaunching = threading.Event()
  if workers is not None and config.fault.elastic:
    threading.Thread(
      target=_relaunch, args=(workers, stop_relaunching), name="relaunch", daemon=True
    ).start()
  try:
    while True:
      try:
        return run_once(config)
      except WorkerLost as e:
        if restarts >= config.fault.max_restarts:
          raise
        restarts += 1
        log.error(
          "%s; restart %d of %d: resuming from the last checkpoint",
          e,
          restarts,
          config.fault.max_restarts,
        )
        if workers is not None:
          with workers.lock:
            _log_exits(workers)
            workers.stop()
            workers.start()
        else:
          _wait_for_workers(config)
  finally:
    stop_relaunching.set()
    if workers is not None:
      with workers.lock:
        workers.stop()


def _log_exits(workers) -> None:
  """One line for each launched worker whose process has ended (how, and its log file): a
  restart replaces every worker, and this is then the only record of why one had gone."""
  for name, proc in zip(workers.names, workers.procs, strict=True):
    if proc is not None and proc.poll() is not None:
      log.warning(
        "worker %s (pid %d) %s (its log: %s)",
        name,
        proc.pid,
        processes.describe_exit(proc.returncode),
        os.path.join(workers.log_dir, f"{name}.log"),
      )


def _relaunch(workers, stop: threading.Event, period_s: float = 0.2) -> None:
  """Elastic pods: starts again, on its old port, every worker whose process has exited, until
  `stop`; a worker that cannot start is left down (one line)."""
  down: set[int] = set()
  while not stop.wait(period_s):
    with workers.lock:
      if stop.is_set():
        return
      for i, proc in enumerate(workers.procs):
        if i in down or proc is None or proc.poll() is None:
          continue
        how = processes.describe_exit(proc.returncode)
        try:
          workers.start([i])
        except RuntimeError as e:
          log.error("worker %s %s and could not be started again: %s", workers.names[i], how, e)
          down.add(i)
          continue
        log.warning(
          "worker %s (pid %d) %s; relaunched it on port %d (pid %d)",
          workers.names[i],
          proc.pid,
          how,
          workers.ports[i],
          workers.procs[i].pid,
        )


def _wait_for_workers(config, timeout_s: float = 300.0) -> None:
  """Externally started workers: wait until every address answers (someone restarts them).
  Only a worker not up (UNAVAILABLE, DEADLINE_EXCEEDED) is waited for: one that refuses the
  token or the TLS handshake is a ConfigError at once (WorkerClient), any other error raised."""
  import grpc

  from pwtrain.backend.remote.client import WorkerClient

  token = auth.read_token(config.backend.token_file, config.backend.token_env)
  deadline = time.monotonic() + timeout_s
  clients = []
  down = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
  for address in config.backend.workers:
    while True:
      try:
        client = WorkerClient(
          address,
          token,
          timeout_s=config.backend.rpc_timeout_s,
          tls_ca=config.backend.tls_ca,
          wait=False,
        )
        clients.append(client)
        break
      except grpc.RpcError as e:
        if e.code() not in down:
          raise
        if time.monotonic() > deadline:
          raise WorkerLost(
            f"at {address}", f"its worker did not come back within {timeout_s:.0f} s"
          ) from None
        time.sleep(1.0)
  # The survivors still hold the lost session's queued ops and pinned values: drop them.
  for client in clients:
    client.reset()
    client.close()


def _compile_cache_env() -> dict:
  """The controller's persistent compilation cache, for the workers it launches on this machine:
  a relaunched worker loads its programs instead of compiling them again."""
  import jax

  directory = jax.config.jax_compilation_cache_dir
  if not directory:
    return {}
  return {
    "JAX_COMPILATION_CACHE_DIR": directory,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
