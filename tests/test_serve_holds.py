"""What attached serving (serve.enabled) holds while the run trains, measured on a real run with
its server on 127.0.0.1 and clients on threads: the served weights are the training state's own
(the device bytes grow by the serving caches alone, with no parameter copy), every response's
weights are at most one step behind the steps finished when it started, and a pod's return
(elastic pods) moves serving back without failing a request.
"""

import contextlib
import gc
import logging
import threading
import time

import httpx
import jax
import pytest
from helpers import Gated, StreamError, small_config, streamed_chunks, weights_step

from pwtrain import metrics as metrics_lib
from pwtrain import serve, train
from pwtrain.serve.server import device_bytes

STEPS = 8
REQUESTS = 30  # served before the device bytes are measured again
MEASURE_AT = 6  # batch (0-based) read once the requests are served: steps 1-6 have finished
CLIENTS = 4
pytestmark = pytest.mark.slow  # a training run each, with a server and its clients
BASE = {"serve.enabled": True, "serve.max_len": 64, "serve.prefill_chunk": 16, "serve.max_batch": 4}


class _Watch:
  """What the test sees of the run, read where the run does its work: the steps finished (each
  step's metrics computed), the attached server, and the device bytes when it attached."""

  def __init__(self):
    self.finished = 0
    self.server = None
    self.attach_bytes = None
    self._lock = threading.Condition()
    self._pending: list = []
    self._stop = False
    self._thread = threading.Thread(target=self._confirm, daemon=True)
    self._thread.start()

  def record(self, step: int, metrics_future) -> None:
    with self._lock:
      self._pending.append((step, metrics_future))
      self._lock.notify()

  def _confirm(self) -> None:
    """Steps finish in order: each step's metrics are waited for, then it counts as finished
    (observed at most a little late, which makes `finished` a lower bound)."""
    while True:
      with self._lock:
        while not self._pending and not self._stop:
          self._lock.wait()
        if self._stop and not self._pending:
          return
        step, future = self._pending.pop(0)
      with contextlib.suppress(Exception):  # a step failed (a lost pod): its rerun counts
        jax.block_until_ready(future.result() if hasattr(future, "result") else future)
        with self._lock:
          self.finished = max(self.finished, step)

  def close(self) -> None:
    with self._lock:
      self._stop = True
      self._lock.notify()
    self._thread.join()


def _watched(monkeypatch, watch: _Watch, gates: dict, *, steps: bool = True) -> None:
  """Wraps the run's own functions to observe it: MetricsLogger.record (each step's metrics
  future), serve.attached (the device bytes just before the server attaches, and the server),
  and the training batches (reading batch i first waits until `gates[i]()` holds). Not
  `steps`: the steps are not watched (elastic pods confirm a step as its metrics are read, on
  the run's thread alone)."""
  record, attached, batches = metrics_lib.MetricsLogger.record, serve.attached, train._train_batches

  def recording(self, step, future, host=None):
    watch.record(step, future)
    return record(self, step, future, host)

  @contextlib.contextmanager
  def attaching(config, controller, current, state, workdir, sock, tokenizer=None):
    jax.block_until_ready(state)
    gc.collect()
    watch.attach_bytes = device_bytes()
    with attached(config, controller, current, state, workdir, sock, tokenizer) as server:
      watch.server = server
      yield server

  def gated(*args):
    return Gated(batches(*args), gates)

  if steps:
    monkeypatch.setattr(metrics_lib.MetricsLogger, "record", recording)
  monkeypatch.setattr(serve, "attached", attaching)
  monkeypatch.setattr(train, "_train_batches", gated)


def _served_url(watch: _Watch, done: threading.Event) -> str | None:
  """The attached server's URL once it has attached and answers /health; None if `done` is set
  first."""
  while not done.is_set():
    if watch.server is not None:
      try:
        if httpx.get(f"{watch.server.url}/health").status_code == 200:
          return watch.server.url
      except httpx.HTTPError:
        pass
    time.sleep(0.02)
  return None


def _stream(http: httpx.Client, body: dict) -> list[int]:
  """A streamed completion: the step of each token's weights (its chunk's fingerprint); raises
  on an error chunk or status."""
  return [weights_step(chunk) for chunk in streamed_chunks(http, body)]


def _complete(http: httpx.Client, body: dict) -> list[int]:
  """A completion: the step of each of its tokens' weights (its choices' runs of steps)."""
  response = http.post("/v1/completions", json=body)
  response.raise_for_status()
  return [
    run["step"]
    for c in response.json()["choices"]
    for run in c["weights"]
    for _ in range(run["tokens"])
  ]


# -- one run serving while it trains -----------------------------------------------------------


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
  """A run of STEPS steps serving its live parameters to CLIENTS clients, who send REQUESTS
  requests (streamed and not, in turn) from the server's start, each noting the steps finished
  when it started. Batch 2 waits for 4 responses (the weights move while requests are served);
  batch MEASURE_AT waits until the REQUESTS are served, the steps before it finished and the
  engine idle, then the device bytes are measured again."""
  workdir = tmp_path_factory.mktemp("served")
  config = small_config(**{**BASE, "train.num_steps": STEPS, "serve.port": 0})
  watch = _Watch()
  served: list = []  # (steps finished at its start, its tokens' steps) or the exception
  lock = threading.Lock()
  tickets = [0]
  measured = {}

  def measure() -> bool:
    with lock:
      if len(served) < REQUESTS or watch.finished < MEASURE_AT:
        return False
    status = watch.server.engine.status()
    if status["busy"] or status["waiting"]:
      return False
    gc.collect()
    measured["bytes"] = device_bytes()
    measured["caches"] = device_bytes(
      [f.result() for f in watch.server.engine._carried.values()]
    )  # caches, `last`
    return True

  gates = {2: lambda: len(served) >= 4, MEASURE_AT: measure}
  done = threading.Event()

  def client(i: int) -> None:
    if (url := _served_url(watch, done)) is None:
      return
    with httpx.Client(base_url=url, timeout=120) as http:
      while True:
        with lock:  # REQUESTS in all
          n, tickets[0] = tickets[0], tickets[0] + 1
        if n >= REQUESTS:
          return
        body = {"prompt": "def ", "max_tokens": 8, "temperature": 0.8, "seed": n}
        started = watch.finished
        try:
          steps = (_stream if n % 2 else _complete)(http, body)
          got = (started, steps)
        except (httpx.HTTPError, StreamError) as e:
          got = e
        with lock:
          served.append(got)

  with pytest.MonkeyPatch.context() as monkeypatch:
    _watched(monkeypatch, watch, gates)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
      t.start()
    try:
      result = train.run(config, str(workdir), show_progress=False)
    finally:
      done.set()
      for t in threads:
        t.join()
      watch.close()
  return {"result": result, "served": served, "measured": measured, "watch": watch}


def test_serving_copies_no_parameters(served_run):
  """After REQUESTS served requests, with the steps before finished and the engine idle, the
  process's device bytes are those when the server attached (the training state) plus the
  serving caches' alone: a copy of the parameters, or of anything near their size, would show
  as a growth of that much."""
  measured, watch = served_run["measured"], served_run["watch"]
  assert "bytes" in measured, f"never measured: {len(served_run['served'])} served"
  params = device_bytes(served_run["result"].state["params"])
  growth = measured["bytes"] - watch.attach_bytes
  other = growth - measured["caches"]
  assert measured["caches"] > 0
  assert abs(other) < params / 4, (
    f"device bytes grew by {growth} B with serving: caches {measured['caches']} B and {other} B "
    f"more (the parameters are {params} B)"
  )


def test_every_response_is_at_most_one_step_stale(served_run):
  """Every token of every response (streamed or not) came from weights at most one step older
  than the newest step finished when the request was sent; and the weights moved on while the
  requests were served."""
  served = served_run["served"]
  failed = [r for r in served if isinstance(r, Exception)]
  assert not failed, failed[:3]
  assert len(served) >= REQUESTS
  stale = [(started, steps) for started, steps in served if min(steps) < started - 1]
  assert not stale, f"(steps finished at the start, the tokens' steps): {stale[:3]}"
  assert len({s for _, steps in served for s in steps}) > 1, "the weights never moved"
  assert max(started for started, _ in served) >= 2, "no request started after a step finished"


# -- elastic pods: a pod lost and rejoining under streaming clients ---------------------------

STREAMS = 8


def test_a_rejoin_moves_serving_back_without_failing_a_request(tmp_path, caplog):
  """2 pods of one island each, fault.elastic: pod 1 (served from) is lost before step 3 and
  rejoins before step 6, while STREAMS clients stream completions all along. Serving moves to
  pod 0 and back to pod 1, and no stream fails: at the loss and at the return the engine starts
  again on the live weights, with pieces built before the loss (every pod's at the start: the
  failover compiles nothing). (Batch 1 waits until every client streams, batch 4 until serving
  is on pod 0 and every client streams again, so the rejoin meets streams in flight; batch 7
  until serving is back on pod 1, then the clients stop, so the run's end cuts nothing.)"""
  config = small_config(
    **{**BASE, "train.num_steps": 10, "serve.port": 0, "serve.max_batch": STREAMS,
       "parallel.islands": 2, "parallel.pods": 2, "fault.elastic": True,
       "fault.inject": "kill:pod1@step3,rejoin:pod1@step6"}
  )  # fmt: skip
  watch = _Watch()
  lock = threading.Lock()
  streaming = [False] * STREAMS  # a stream of the client's has given a token and not ended
  finished = [0] * STREAMS  # the client's streams served whole
  failed: list = []
  islands: list = []  # the islands served from, in turn
  stop, done = threading.Event(), threading.Event()
  exited = [False] * STREAMS

  def served_from(name: str) -> bool:
    now = watch.server.engine.status()["islands"] if watch.server else []
    if now and (not islands or islands[-1] != now):
      islands.append(now)
    return now == [name]

  def all_streaming() -> bool:
    with lock:
      return all(streaming)

  def back() -> bool:
    if not served_from("island1") or ["island0"] not in islands:
      return False
    stop.set()
    return all(exited)

  gates = {
    1: lambda: served_from("island1") and all_streaming(),
    4: lambda: served_from("island0") and all_streaming(),
    7: back,
  }

  def client(i: int) -> None:
    try:
      if (url := _served_url(watch, done)) is None:
        return
      with httpx.Client(base_url=url, timeout=120) as http:
        n = 0
        while not stop.is_set():
          body = {"prompt": "def ", "max_tokens": 40, "temperature": 0.8, "seed": 100 * i + n}
          n += 1
          try:
            for _ in streamed_chunks(http, body):
              with lock:
                streaming[i] = True
            with lock:
              finished[i] += 1
          except (httpx.HTTPError, StreamError) as e:
            with lock:
              failed.append(f"client {i}: {e}")
          finally:
            with lock:
              streaming[i] = False
    finally:
      exited[i] = True

  with pytest.MonkeyPatch.context() as monkeypatch:
    _watched(monkeypatch, watch, gates, steps=False)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(STREAMS)]
    for t in threads:
      t.start()
    try:
      with caplog.at_level(logging.INFO, logger="pwtrain.serve"):
        result = train.run(config, str(tmp_path), show_progress=False)
    finally:
      done.set()
      stop.set()
      for t in threads:
        t.join()
      watch.close()
  assert result.final_step == 10
  assert islands == [["island1"], ["island0"], ["island1"]], islands
  assert not failed, failed[:3]
  assert all(finished), finished
  events = [m.split(" compiled")[0] if "compiled" in m else m for m in caplog.messages]
  events = [m for m in events if m.startswith(("serving pieces", "serving from"))]
  assert events[:3] == [
    "serving pieces for islands island1", "serving pieces for islands island0",
    "serving from islands island1",
  ] and not any(m.startswith("serving pieces") for m in events[3:]), events  # fmt: skip
