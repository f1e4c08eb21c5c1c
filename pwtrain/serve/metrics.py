"""The server's metrics, as Prometheus' text format (GET /metrics): counters and latency histograms
the engine and the HTTP side add to, and gauges read when scraped (slots, queue, the served step,
each island's busy time by client: backend/policy.py's share).
"""

import bisect
import collections
import threading

PREFIX = "pwtrain_serve_"
# Seconds: time to first token and time per output token (ms to a minute).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
HELP = {
  "requests_total": "HTTP requests answered, by status code",
  "completion_tokens_total": "tokens generated",
  "prompt_tokens_total": "prompt tokens of the requests (each with the EOS it starts with)",
  "prefill_chunks_total": "prefill programs run",
  "decode_steps_total": "decode programs run (one token of every decoding slot)",
  "cancelled_total": "sequences whose client left before their end",
  "finished_stop_total": "sequences ended by EOS or a stop string",
  "finished_length_total": "sequences ended by max_tokens",
  "time_to_first_token_seconds": "from a request's arrival to its first token",
  "time_per_output_token_seconds": "between a sequence's tokens",
  "device_bytes": "bytes of this process's live device arrays (weights, caches, training state)",
  "kv_cache_bytes": "bytes of the serving KV caches",
  "weights_step": "the step of the weights of the newest token (-1: none yet)",
}


class Stats:
  """Thread-safe counters and histograms."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()
    self._labelled: dict = collections.defaultdict(collections.Counter)
    self._histograms: dict = {}

  def count(self, name: str, value: float = 1, **labels) -> None:
    with self._lock:
      if labels:
        self._labelled[name][tuple(sorted(labels.items()))] += value
      else:
        self._counts[name] += value

  def observe(self, name: str, seconds: float) -> None:
    with self._lock:
      buckets, total = self._histograms.setdefault(name, ([0] * len(BUCKETS), [0.0, 0]))
      index = bisect.bisect_left(BUCKETS, seconds)
      if index < len(BUCKETS):
        buckets[index] += 1
      total[0] += seconds
      total[1] += 1

  def value(self, name: str) -> float:
    with self._lock:
      return self._counts[name]

  def render(self, gauges: dict[str, float], island_time: dict) -> str:
    """The metrics page: every counter and histogram, `gauges` ({name: value}) and
    `island_time` ({island: {"priority", "ordinary"}} busy seconds)."""
    lines = []

    def head(name, kind):
      lines.append(f"# HELP {PREFIX}{name} {HELP.get(name, name.replace('_', ' '))}")
      lines.append(f"# TYPE {PREFIX}{name} {kind}")

    with self._lock:
      for name in sorted(self._counts):
        head(f"{name}_total", "counter")
        lines.append(f"{PREFIX}{name}_total {self._counts[name]:g}")
      for name in sorted(self._labelled):
        head(f"{name}_total", "counter")
        for labels, value in sorted(self._labelled[name].items()):
          tags = ",".join(f'{k}="{v}"' for k, v in labels)
          lines.append(f"{PREFIX}{name}_total{{{tags}}} {value:g}")
      for name in sorted(self._histograms):
        buckets, (total, count) = self._histograms[name]
        head(name, "histogram")
        cumulative = 0
        for bound, n in zip(BUCKETS, buckets, strict=True):
          cumulative += n
          lines.append(f'{PREFIX}{name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines.append(f'{PREFIX}{name}_bucket{{le="+Inf"}} {count}')
        lines.append(f"{PREFIX}{name}_sum {total:.6f}")
        lines.append(f"{PREFIX}{name}_count {count}")
    for name, value in gauges.items():
      head(name, "gauge")
      lines.append(f"{PREFIX}{name} {value:g}")
    if island_time:
      head("island_busy_seconds", "counter")
      for island, times in sorted(island_time.items()):
        for client, seconds in sorted(times.items()):
          lines.append(
            f'{PREFIX}island_busy_seconds{{island="{island}",client="{client}"}} {seconds:.6f}'
          )
    return "\n".join(lines) + "\n"
