"""A worker's Receive operations run on a bounded pool (backend/remote/receives.py): many
transfers enqueued at once never run more than `receives.THREADS` threads, and every one of them
completes.

Two real workers are served in this process on loopback (server.serve): the receiver's pulls of
values the source does not hold yet wait in the source's Fetch, so each running transfer holds a
pool thread until the values are put; the receiver's pool threads are counted while they wait
and while they drain.
"""

import threading
import time

import grpc
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pwtrain.backend.remote import arrays, auth, receives, server
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import channel_options

TOKEN = "receives-test-token"
OPS = 3 * receives.THREADS  # more transfers than threads


def _receive_threads() -> set:
  """The live threads of Receive pools (receives.py names them receive_<n>)."""
  return {t for t in threading.enumerate() if t.name.startswith("receive")}


def test_many_receives_run_on_at_most_threads_threads_and_all_complete():
  before = _receive_threads()  # pools of workers other tests started in this process
  source, _, source_port = server.serve("src", TOKEN, devices=jax.devices()[:1])
  sink, _, sink_port = server.serve("dst", TOKEN, devices=jax.devices()[1:2])
  md = auth.call_metadata(TOKEN)
  stubs = {
    port: pb_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()))
    for port in (source_port, sink_port)
  }
  most = 0
  try:
    whole = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("x",)), PartitionSpec())
    ops = [
      pb.Op(
        name=f"t{i}",
        receive=pb.Receive(
          source=f"127.0.0.1:{source_port}",
          handle=f"v{i}",  # not on the source yet: the pull waits in its Fetch
          output=pb.Output(handle=f"w{i}", uses=0),
          shardings=[arrays.sharding_to_proto(whole)],
        ),
      )
      for i in range(OPS)
    ]
    stubs[sink_port].Enqueue(pb.EnqueueRequest(ops=ops), metadata=md, timeout=30)
    deadline = time.monotonic() + 60
    while len(_receive_threads() - before) < receives.THREADS:  # the pool fills up
      assert time.monotonic() < deadline, len(_receive_threads() - before)
      time.sleep(0.01)
    for _ in range(50):  # and stays full, no thread more, while every pull waits
      most = max(most, len(_receive_threads() - before))
      time.sleep(0.01)
    assert most == receives.THREADS, most

    counting = threading.Event()

    def count():
      nonlocal most
      while not counting.is_set():
        most = max(most, len(_receive_threads() - before))
        time.sleep(0.001)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    for i in range(OPS):
      chunks = arrays.to_chunks(f"v{i}", [np.full(4, i, np.float32)], uses=0)
      stubs[source_port].Put(iter(chunks), metadata=md, timeout=30)
    for i in range(OPS):
      request = pb.FetchRequest(handle=f"w{i}", release=True)
      _, [(got, _)] = arrays.from_chunks(stubs[sink_port].Fetch(request, metadata=md, timeout=60))
      np.testing.assert_array_equal(got, np.full(4, i, np.float32))
    counting.set()
    counter.join()
    assert most == receives.THREADS, most
  finally:
    source.stop(None)
    sink.stop(None)
