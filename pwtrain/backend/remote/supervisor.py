"""Remote mode's supervisor: starts the island workers if asked, and survives losing one.

A lost worker (dead, or silent for `fault.heartbeat_s` x 3) fails the step in flight with
`WorkerLost`. With `fault.max_restarts > 0` the supervisor then restarts the workers it launched
(on their old ports), or waits for externally started ones to answer again and resets them,
and runs the job again: it resumes from the last committed checkpoint, so at most the steps
since then are lost.
"""

import copy
import logging
import os
import time

from pwtrain.backend.remote import auth, launcher
from pwtrain.backend.remote.client import WorkerLost

log = logging.getLogger(__name__)


def run_remote(config, run_once, island_sizes: list[int]):
  """`run_once(config)` with workers launched/restarted as the config says;
  `island_sizes` are the devices of each island (the plan's), for workers it launches."""
  config = copy.deepcopy(config)  # backend.workers is filled in for launched workers
  workers = None
  if config.backend.launch_workers:
    token = os.environ.get(config.backend.token_env) or None
    workers = launcher.launch(list(island_sizes), token=token)
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
          workers.stop()
          workers.start()
        else:
          _wait_for_workers(config)
  finally:
    if workers is not None:
      workers.stop()


def _wait_for_workers(config, timeout_s: float = 300.0) -> None:
  """Externally started workers: wait until every address answers (someone restarts them)."""
  from pwtrain.backend.remote.client import WorkerClient

  token = auth.read_token(config.backend.token_file, config.backend.token_env)
  deadline = time.monotonic() + timeout_s
  clients = []
  for address in config.backend.workers:
    while True:
      try:
        clients.append(WorkerClient(address, token, timeout_s=config.backend.rpc_timeout_s))
        break
      except Exception:  # noqa: BLE001 - not up yet
        if time.monotonic() > deadline:
          raise WorkerLost(f"worker {address} did not come back within {timeout_s:.0f} s") from None
        time.sleep(1.0)
  # The survivors still hold the lost session's queued ops and pinned values: drop them.
  for client in clients:
    client.reset()
    client.close()
