"""The server's metrics (GET /metrics) through `prometheus_client`, in a registry of the server's
own: counters and latency histograms that the engine and the HTTP side add to, gauges read when
scraped (slots, queue, the served step, each island's busy time by client: backend/policy.py's
share), and the standard process metrics (CPU seconds, resident memory, open files, Python's GC).

Names are `pwtrain_serve_<name>`; a counter `<name>` is exposed as `<name>_total` (with its
`_created` time), its value exact (not rounded). `requests_total` is labelled by `code` (the
HTTP status) and `path` (the route: "/v1/models/{id}" for any model id, "other" for a path that
is none of the server's).
"""

import threading
from collections.abc import Callable

from prometheus_client import (
  CollectorRegistry,
  Counter,
  GCCollector,
  Histogram,
  PlatformCollector,
  ProcessCollector,
  generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "pwtrain_serve_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: time to first token and time per output token (ms to a minute).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
COUNTERS = {
  "completion_tokens": "tokens generated",
  "prompt_tokens": "prompt tokens of the requests (each with the special token it starts with)",
  "prefill_chunks": "prefill programs run",
  "decode_steps": "decode programs run (one token of every decoding slot)",
  "cancelled": "sequences whose client left before their end",
  "finished_stop": "sequences ended by EOS or a stop string",
  "finished_length": "sequences ended by max_tokens",
  "failed": "sequences ended by an error of the server (the error is in the response)",
}
HISTOGRAMS = {
  "time_to_first_token_seconds": "from a request's arrival to its first token",
  "time_per_output_token_seconds": "between a sequence's tokens",
}
GAUGES = {
  "slots": "KV-cache slots (serve.max_batch)",
  "slots_busy": "slots holding a sequence",
  "queue_waiting": "sequences waiting for a slot",
  "weights_step": "the step of the weights of the newest token (-1: none yet)",
  "kv_cache_bytes": "bytes of the serving KV caches",
  "device_bytes": "bytes of this process's live device arrays (weights, caches, training state)",
}
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Stats:
  """Thread-safe counters and histograms in the server's own registry (module doc)."""

  def __init__(self):
    self.registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=self.registry)
    PlatformCollector(registry=self.registry)
    GCCollector(registry=self.registry)
    self._counters = {
      name: Counter(PREFIX + name, doc, registry=self.registry) for name, doc in COUNTERS.items()
    }
    self._requests = Counter(
      PREFIX + "requests", "HTTP requests answered, by status code and path", ("code", "path"),
      registry=self.registry,
    )  # fmt: skip
    self._histograms = {
      name: Histogram(PREFIX + name, doc, buckets=BUCKETS, registry=self.registry)
      for name, doc in HISTOGRAMS.items()
    }
    self._lock = threading.Lock()
    self._values = dict.fromkeys(COUNTERS, 0)  # the counters' exact values, for `value`

  def count(self, name: str, value: int = 1) -> None:
    with self._lock:
      self._values[name] += value
    self._counters[name].inc(value)

  def request(self, code: int, path: str) -> None:
    """An HTTP response of status `code` to `path`."""
    self._requests.labels(code=str(code), path=route(path)).inc()

  def observe(self, name: str, seconds: float) -> None:
    self._histograms[name].observe(seconds)

  def value(self, name: str) -> int:
    with self._lock:
      return self._values[name]

  def read_when_scraped(self, gauges: Callable[[], dict], island_time: Callable | None) -> None:
    """Adds the gauges `gauges()` gives ({name in GAUGES: value}) and, with `island_time`, each
    island's busy seconds by client ({island: {client: seconds}}), read at every scrape."""
    self.registry.register(_Scraped(gauges, island_time))

  def render(self) -> bytes:
    return generate_latest(self.registry)


def route(path: str) -> str:
  """`path` as the `path` label: one of PATHS, "/v1/models/{id}", or "other" (bounded)."""
  if path in PATHS:
    return path
  if path.startswith("/v1/models/"):
    return "/v1/models/{id}"
  return "other"


class _Scraped(Collector):
  def __init__(self, gauges: Callable[[], dict], island_time: Callable | None):
    self._gauges = gauges
    self._island_time = island_time

  def describe(self):
    return []  # read at scrape time only (nothing to check at registration)

  def collect(self):
    for name, value in self._gauges().items():
      yield GaugeMetricFamily(PREFIX + name, GAUGES[name], value=value)
    if self._island_time is not None:
      family = CounterMetricFamily(
        PREFIX + "island_busy_seconds", "each island's busy seconds, by client",
        labels=("island", "client"),
      )  # fmt: skip
      for island, times in sorted(self._island_time().items()):
        for client, seconds in sorted(times.items()):
          family.add_metric((island, client), seconds)
      yield family
