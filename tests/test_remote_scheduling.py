"""A remote worker's queue (backend/remote/server.py) on a real worker process on loopback: no
silent copy of an input whose sharding differs from its program's, and a priority program
placed ahead of queued training work.

One worker of two devices is started for the module; a program whose input is a value not yet
put on the worker holds the worker's queue (the worker waits for the input), which is how the
priority test keeps work queued behind it.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pwtrain.backend import Cluster, Controller, Node, Program
from pwtrain.backend.remote import launcher


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  with launcher.launch([2], log_dir=str(tmp_path_factory.mktemp("workers"))) as w:
    yield w


@pytest.fixture(scope="module")
def controller(workers):
  cluster = Cluster.connect(workers.addresses, workers.token, devices=jax.devices()[:2])
  with Controller(cluster, max_inflight=16) as controller:
    yield controller
  cluster.close()


def _health(controller):
  return controller.cluster["island0"].worker.health()


def _shardings(controller):
  mesh = controller.cluster["island0"].mesh({"d": 2})
  return NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())


def _program(controller, name, fn, takes, gives):
  """A one-node program on island0: x (in `takes`) -> y (in `gives`)."""
  arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=takes)
  exe = controller.compile(name, fn, "island0", (arg,), out_shardings=gives)
  return Program((Node(name, exe, ("x",)),), {"y": (name, 0)})


def _log(workers) -> str:
  with open(os.path.join(workers.log_dir, "island0.log")) as f:
    return f.read()


def test_an_input_in_another_sharding_is_a_counted_logged_copy(controller, workers):
  """A value made split over the island's two devices, read twice by a program that takes it
  whole: both reads copy it (8 float32s, 32 bytes each), both copies are counted in Health, and
  the first alone is logged, with the bytes and both shardings."""
  split, whole = _shardings(controller)
  make = _program(controller, "make_split", lambda x: x + 1, whole, split)
  read = _program(controller, "read_whole", lambda x: x * 2, whole, whole)
  before = _health(controller)
  made = controller.run(make, {"x": np.arange(8, dtype=np.float32)})["y"]
  outs = [controller.run(read, {"x": made})["y"] for _ in range(2)]
  for out in outs:
    np.testing.assert_array_equal(np.asarray(out.result()), (np.arange(8) + 1) * 2)
  after = _health(controller)
  assert after.copied_inputs - before.copied_inputs == 2
  assert after.copied_bytes - before.copied_bytes == 2 * 32
  logged = [
    line for line in _log(workers).splitlines() if "read_whole" in line and "copied" in line
  ]
  assert len(logged) == 1, logged
  assert "input 0 ((8,), 32 bytes) arrived as P('d',); the program takes P()" in logged[0]
