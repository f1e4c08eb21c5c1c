"""Put on PYTHONPATH of a distributed run's processes (tests/test_distributed.py): once a process
has joined its run, a daemon thread of its own waits inside JAX's C++ for as long as the process
lives (a key that never comes, 50 ms at a time, from a coordination service of its own, apart
from the run's), as the run's own threads wait on JAX. At interpreter finalization CPython ends
such a thread with pthread_exit when its call returns, and the unwind through JAX's C++ frames
aborts the process ("terminate called after throwing an instance of ''", "FATAL: exception not
rethrown"): pwtrain.main ends a distributed process without finalizing (main._leave)."""

import socket
import sys
import threading
import time


def _joined() -> bool:
  state = getattr(sys.modules.get("jax._src.distributed"), "global_state", None)
  return getattr(state, "client", None) is not None


def _wait_in_jax() -> None:
  while not _joined():
    time.sleep(0.1)
  from jax._src.lib import _jax

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  service = _jax.get_distributed_runtime_service(address, 1)
  client = _jax.get_distributed_runtime_client(address, 0)
  client.connect()
  while service is not None:
    try:
      client.blocking_key_value_get("never", 50)
    except Exception:  # noqa: BLE001 - the deadline, every time
      pass


threading.Thread(target=_wait_in_jax, name="waits-in-jax", daemon=True).start()
