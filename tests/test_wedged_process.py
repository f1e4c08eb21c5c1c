"""A wedged process ends itself (pwtrain/liveness.py, backend/progress.py): in a distributed run,
a process one of whose computations runs longer than fault.progress_timeout_s says so in one
line and exits with liveness.WEDGED_EXIT, though its beat thread beats on; one that waits (for
an input a peer sends, on the coordination service) runs nothing and goes on.

Real processes: each is a distributed run of one process (JAX's coordination service on
loopback, the real beat thread setting its count there) whose backend Controller runs a real
compiled program on its island's scheduler.
"""

import os
import subprocess
import sys
import time

import pytest

from pwtrain import liveness
from pwtrain.launch import free_port

PROGRESS_TIMEOUT_S = 2.0
HEARTBEAT_S = 0.25

# The process: joins a distributed run of one, beats, and runs `forever` (a computation that
# never ends) or `waits` (a computation whose input comes 3 x the timeout later, while the main
# thread waits as long on the coordination service, as for a barrier).
_CHILD = """
import concurrent.futures, sys, threading, time
import jax, jax.numpy as jnp, numpy as np
from jax._src import distributed as jax_distributed
from jax.sharding import NamedSharding, PartitionSpec
from pwtrain import liveness
from pwtrain.backend import Cluster, Controller, Node, Program, progress

what, serialize, port, beat_s, timeout_s = sys.argv[1:]
timeout_s = float(timeout_s)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
liveness.start(float(beat_s), timeout_s, progress.watch())  # as main.py does

def forever(x):  # x stays >= 0: adding 1 to a large float32 changes nothing
  return jax.lax.while_loop(lambda c: c[0] >= 0, lambda c: c + 1.0, x)

def step(x):
  return x * 2.0

fn = forever if what == "forever" else step
with Controller(Cluster.local(1), serialize_execution=serialize == "serial") as controller:
  island = controller.cluster["island0"]
  sharding = NamedSharding(island.mesh({"data": 1}), PartitionSpec())
  arg = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)
  exe = controller.compile(fn.__name__, fn, "island0", (arg,), out_shardings=sharding)
  program = Program(nodes=(Node("run", exe, ("x",)),), outputs={"y": ("run", 0)})
  x = jax.device_put(np.zeros(4, np.float32), sharding)
  if what == "forever":
    print("launched", time.monotonic(), flush=True)
    controller.run(program, {"x": x})["y"].result().block_until_ready()
  else:  # its input arrives later (a peer's transfer); meanwhile a wait on the service
    arrives = concurrent.futures.Future()
    client = jax_distributed.global_state.client
    def send():
      time.sleep(3 * timeout_s)
      client.key_value_set("peer/ready", "1")
      arrives.set_result(x)
    threading.Thread(target=send, daemon=True).start()
    out = controller.run(program, {"x": arrives})
    client.blocking_key_value_get("peer/ready", int(60e3))
    assert float(out["y"].result()[0]) == 0.0
    print("done", flush=True)
liveness.stop()
"""


def _start(what: str, serialize: str) -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  args = [what, serialize, str(free_port()), str(HEARTBEAT_S), str(PROGRESS_TIMEOUT_S)]
  return subprocess.Popen(
    [sys.executable, "-c", _CHILD, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
  )


@pytest.mark.processes
def test_a_wedged_process_ends_itself_and_a_waiting_one_does_not():
  """Three processes at once: two run a computation that never ends (serialized execution, as
  on CPU, and not serialized, as on accelerators): each, though its beat thread beats on, says
  `process 0 is wedged: one program has run for S s ...` in one line and exits with
  WEDGED_EXIT, within the timeout and a few beats of the launch. The third waits 3 x the
  timeout for its computation's input (a transfer from a peer, say) and, meanwhile, on the
  coordination service (a barrier, say): nothing runs, so it is not wedged, and it finishes."""
  procs = {
    (what, serialize): _start(what, serialize)
    for what, serialize in (("forever", "serial"), ("forever", "unserialized"), ("waits", "serial"))
  }
  ended = {}  # key -> time.monotonic() once its process had exited
  try:
    deadline = time.monotonic() + 60
    while len(ended) < len(procs) and time.monotonic() < deadline:
      for key, proc in procs.items():
        if key not in ended and proc.poll() is not None:
          ended[key] = time.monotonic()
      time.sleep(0.05)
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
  outs = {key: proc.communicate(timeout=10) for key, proc in procs.items()}
  for serialize in ("serial", "unserialized"):
    proc, (out, err) = procs["forever", serialize], outs["forever", serialize]
    err = err.decode()
    assert proc.returncode == liveness.WEDGED_EXIT, (serialize, proc.returncode, err[-3000:])
    (said,) = [line for line in err.splitlines() if "wedged" in line]
    assert said.split("] ", 1)[-1].startswith("process 0 is wedged: one program has run for ")
    assert f"fault.progress_timeout_s={PROGRESS_TIMEOUT_S:g}); it ends" in said, said
    assert "Traceback" not in err, err[-3000:]
    launched = float(out.decode().split()[1])
    # Ended within the timeout, a beat, and a margin for a loaded machine; the line's own figure
    # is over the timeout and within a beat (and the margin) of it.
    took = ended["forever", serialize] - launched
    assert PROGRESS_TIMEOUT_S < took < PROGRESS_TIMEOUT_S + 4 * HEARTBEAT_S + 10, (serialize, took)
    print(f"{serialize}: ended {took:.2f} s after the launch ({said.split('] ', 1)[-1]})")
    running_s = float(said.split("has run for ")[1].split(" s")[0])
    assert PROGRESS_TIMEOUT_S <= running_s < PROGRESS_TIMEOUT_S + HEARTBEAT_S + 5, said  # 1 digit
  waits, (out, err) = procs["waits", "serial"], outs["waits", "serial"]
  assert waits.returncode == 0 and out.decode().strip() == "done", err.decode()[-3000:]
  assert "wedged" not in err.decode(), err.decode()[-3000:]
