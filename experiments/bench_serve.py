"""Serving while training (pwtrain/serve/): what it costs training, its latency and throughput,
how fresh its weights are and what memory it adds, against the usual separate server.

  python experiments/bench_serve.py                                  # every section
  python experiments/bench_serve.py --sections=training --blocks=5 --block_s=10
  python experiments/bench_serve.py --sections=training --path=unserialized --tokens=8
  python experiments/bench_serve.py --sections=flood --path=unserialized

--path: serialized (the CPU default: each computation runs to completion, one at a time) or
unserialized (islands of one device with serialization off: the path GPUs and TPUs take, where
the launch window keeps work in the island's queue; remote workers on CPU have only the first).

training    palm_tiny (one island of 8 devices, 16 x 128 tokens a step) trains on random batches
            on a thread, as pwtrain.train drives it, with the server attached (serve.enabled's
            path: its programs a priority client of the run's controller, serve.share=0.2).
            Closed-loop clients (each sends its next request when its last one ends; streamed
            completions of --tokens tokens) load it with 0, 1, 4 and 8 clients, in that order in
            each of --blocks blocks of --block_s seconds (after --warmup_s), medians over the
            blocks: training tokens/s against the same block's 0 clients, time to first token
            (TTFT) and time per output token (TPOT, the gaps between a completion's tokens) at
            p50 and p99, output tokens/s, and serving's share of the island's busy time
            (backend/policy.py's clock). TTFT is also given in training step times (the step
            time without clients). Each block runs the loads in a rotated order; each load's
            row pools the completions of all its blocks (p50 and p99 over them, with their
            count) and its training steps over all its blocks' time; every block is printed
            too, with the machine's load average.
remote      the training section in remote mode: palm_tiny's island on one worker process of 8
            devices (pwtrain/backend/remote/), the server attached to the run's controller. The
            workers place serving programs ahead of their queued training steps, without a
            share (the share column is not measurable there: the busy time is the workers').
flood       serving's share of the island under a flood: --flood_clients clients of
            --flood_tokens-token completions (far more than serve.share=--share asks), in blocks
            of three kinds, rotated: no clients, the flood at the share, and the flood at share
            1.0 (what it would take unbounded). The share by three clocks: the policy's own
            (IslandClock, which enforces it), the trace's launch and completion stamps (the
            completion watcher's where execution is not serialized; a node runs from its launch
            or its predecessor's end to its completion), and training's loss of steps/s against
            the blocks without clients (timed by the trainer, from its first to its last step
            finished in the block; it equals the share only where training alone keeps the
            island busy: the "island busy" column, by the trace).
standalone  the same model served from a checkpoint by `pwtrain.serve`'s server (in this
            process, on one device, nothing training): 1, 4 and 8 clients in blocks, medians;
            output tokens/s against the same block's 1 client.
freshness   palm_tiny trains (checkpoint every --checkpoint_every steps) with the server
            attached, and a separate `python -m pwtrain.serve` process serves the same run's
            checkpoints, reloading each new one (serve.reload_poll_s=0.5): one client each (16-
            token completions). Staleness of a response: the steps the trainer had finished
            when it arrived minus the step that produced its last token. Memory: the device
            bytes serving adds (attached: measured around the attach, the KV caches apart;
            separate: the process's own device bytes, its /metrics).
pipeline    decode cost through a pipeline's stage islands: palm_tiny_pipeline (4 stages on 4
            islands of 2 devices) against palm_tiny (one island), attached to an idle run (no
            step running), 1 client: TPOT p50, the programs' nodes and transfers per token.

On this CPU every computation runs alone (the controller serializes them: XLA's CPU
collectives), so serving and training take turns on the two cores rather than overlapping;
real concurrency between islands (a pipeline's decode on one stage while training runs on
another) is not measurable here.
"""

import argparse
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import force_host_devices, load_config, machine, random_batches, write_json

LOADS = (0, 1, 4, 8)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sections", default="training,remote,standalone,freshness,pipeline")
  parser.add_argument("--blocks", type=int, default=3)
  parser.add_argument("--block_s", type=float, default=8.0)
  parser.add_argument("--warmup_s", type=float, default=2.0)
  parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
  parser.add_argument("--checkpoint_every", type=int, default=10)
  parser.add_argument("--freshness_s", type=float, default=40.0)
  parser.add_argument(
    "--path",
    choices=("serialized", "unserialized"),
    default="serialized",
    help="serialized: the CPU default; unserialized: one-device islands with serialization off "
    "(the path accelerators take)",
  )
  parser.add_argument("--share", type=float, default=0.2, help="flood: serve.share")
  parser.add_argument("--flood_clients", type=int, default=16)
  parser.add_argument("--flood_tokens", type=int, default=64)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  force_host_devices(8)
  results = {"machine": machine(), "args": vars(args)}
  sections = args.sections.split(",")
  if "training" in sections:
    results["training"] = training(args)
  if "remote" in sections:
    results["remote"] = training(args, remote=True)
  if "flood" in sections:
    results["flood"] = flood(args)
  if "standalone" in sections:
    results["standalone"] = standalone(args)
  if "freshness" in sections:
    results["freshness"] = freshness(args)
  if "pipeline" in sections:
    results["pipeline"] = pipeline(args)
  if args.out:
    write_json(args.out, results)


# -- the pieces every section uses -------------------------------------------------------------


def _config(name="palm_tiny", path="serialized", **overrides):
  """`name` with a free port and no end; on the unserialized path, islands of one device (the
  path accelerators take; on CPU several multi-device computations at once may deadlock XLA's
  collectives)."""
  if path == "unserialized":
    overrides = {"parallel.devices_per_island": 1, **overrides}
  return load_config(name, {"serve.port": 0, "train.num_steps": 10**6, **overrides})


class Trainer:
  """Steps on random batches on a thread, as pwtrain.train dispatches them; `done`: the steps
  whose metrics have reached the host, with when."""

  def __init__(self, harness, state, every=0, checkpointer=None):
    self.harness, self.state = harness, state
    self.batches = random_batches(harness.config, 4)
    self.done: list[tuple[float, int]] = []
    self.every, self.checkpointer = every, checkpointer
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def start(self):
    self._thread.start()
    return self

  def _loop(self):
    import jax

    pending, step = None, 0
    while not self._stop.is_set():
      out = self.harness.step(self.state, self.batches[step % 4], step)
      self.state, step = out.state, step + 1
      if pending is not None:
        jax.device_get(pending[1].result())
        self.done.append((time.monotonic(), pending[0]))
      pending = (step, out.metrics)
      if self.checkpointer is not None and step % self.every == 0:
        state = {k: v.result() for k, v in self.state.items()}
        whole = self.harness.step_program.to_checkpoint(state)
        self.checkpointer.save(step, whole, {"step": step})
        self.state = state
    jax.device_get(pending[1].result())
    self.done.append((time.monotonic(), pending[0]))

  def started(self, steps: int = 2, timeout_s: float = 600.0) -> "Trainer":
    """Waits until `steps` steps have finished (the programs compiled and running: remote
    workers compile on the first step), so that no block counts the start."""
    deadline = time.monotonic() + timeout_s
    while len(self.done) < steps:
      if time.monotonic() > deadline or not self._thread.is_alive():
        raise RuntimeError(f"the trainer finished {len(self.done)} steps in {timeout_s} s")
      time.sleep(0.05)
    return self

  def finished_at(self, t: float) -> int:
    """The steps finished (their metrics on the host) by time `t`."""
    return max((step for when, step in self.done if when <= t), default=0)

  def steps_between(self, start: float, end: float) -> int:
    return sum(start <= t < end for t, _ in self.done)

  def step_time(self, start: float, end: float) -> tuple[int, float]:
    """(n, seconds): n steps finished in [start, end) after the first one that finished there,
    in `seconds` from that one to the last (no quantization by the block's edges)."""
    times = [t for t, _ in self.done if start <= t < end]
    return (len(times) - 1, times[-1] - times[0]) if len(times) > 1 else (0, 0.0)

  def stop(self):
    self._stop.set()
    self._thread.join()
    self.harness.controller.wait()


class Clients:
  """`count` closed-loop clients in a process of their own (so that their HTTP work does not
  share the trainer's interpreter): streamed completions of `tokens` tokens one after another,
  each recorded as {"start", "times" (of its tokens), "step" (of its last)}, on
  time.monotonic's clock, which every process of the machine shares. `stop` returns them."""

  def __init__(self, url: str, count: int, tokens: int):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    self._stop, self._records = context.Event(), context.Queue()
    self._process = context.Process(
      target=_clients, args=(url, count, tokens, self._stop, self._records), daemon=True
    )
    self._process.start()

  def stop(self) -> list[dict]:
    self._stop.set()
    records = self._records.get()
    self._process.join()
    return records


def _clients(url, count, tokens, stop, out) -> None:
  records = []
  threads = [
    threading.Thread(target=_client, args=(url, tokens, stop, records)) for _ in range(count)
  ]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  out.put(records)


def _client(url, tokens, stop, records) -> None:
  import httpx

  body = {"prompt": "def main(", "max_tokens": tokens, "temperature": 1.0, "stream": True}
  with httpx.Client(base_url=url, timeout=300) as http:
    while not stop.is_set():
      start, times, step = time.monotonic(), [], None
      try:
        with http.stream("POST", "/v1/completions", json=body) as response:
          for line in response.iter_lines():
            if line.startswith("data: {"):
              times.append(time.monotonic())
              step = int(re.search(r"pwtrain-step-(\d+)", line).group(1))
      except httpx.HTTPError:
        return  # the server stopped
      if times:
        records.append({"start": start, "times": times, "step": step})


def _samples(records: list[dict], start: float, end: float) -> dict:
  """The TTFTs and token gaps of the completions that started in [start, end), and the number of
  output tokens that came in it."""
  begun = [r for r in records if start <= r["start"] < end]
  return {
    "ttft": [r["times"][0] - r["start"] for r in begun],
    "firsts": [(r["start"], r["times"][0]) for r in begun],  # (sent, its first token)
    "gaps": [b - a for r in begun for a, b in zip(r["times"], r["times"][1:], strict=False)],
    "tokens": sum(start <= t < end for r in records for t in r["times"]),
    "seconds": end - start,
    "load": os.getloadavg()[0],  # the machine's 1-minute load average at the block's end
  }


def _pooled(samples: list[dict]) -> dict:
  """TTFT, TPOT (p50, p99) over the completions of every block in `samples` together, and output
  tokens/s over their time: one row's columns from the same blocks."""
  import numpy as np

  ttft = [x for s in samples for x in s["ttft"]]
  gaps = [x for s in samples for x in s["gaps"]]
  seconds = sum(s["seconds"] for s in samples)
  pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
  return {
    "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(gaps, 50),
    "tpot_p99": pct(gaps, 99), "tokens_per_s": sum(s["tokens"] for s in samples) / seconds,
    "completions": len(ttft),
  }  # fmt: skip


def _latency(records: list[dict], start: float, end: float) -> dict:
  """_pooled of one block: the completions that started in [start, end)."""
  return _pooled([_samples(records, start, end)])


def _load_block(url, clients: int, args, during=None, tokens=None, at_start=None) -> tuple:
  """`clients` closed-loop clients (completions of `tokens`, default --tokens) for warmup + block
  seconds: their latency figures over the block, `during(start, end, begun)`'s result
  (time.monotonic's clock; `begun`: what `at_start()` gave as the block began), and the block's
  _samples."""
  running = Clients(url, clients, tokens or args.tokens) if clients else None
  time.sleep(args.warmup_s)
  start = time.monotonic()
  begun = at_start() if at_start else None
  time.sleep(args.block_s)
  end = time.monotonic()
  extra = during(start, end, begun) if during else None
  records = running.stop() if running else []
  samples = _samples(records, start, end)
  return (_pooled([samples]) if clients else {}), extra, samples


def _medians(blocks: list[dict]) -> dict:
  keys = blocks[0].keys()
  return {k: statistics.median(b[k] for b in blocks) for k in keys}


def _print_table(title: str, header: list[str], rows: list[list]) -> None:
  print(f"\n{title}")
  print(" | ".join(header))
  for row in rows:
    print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))


# -- sections ----------------------------------------------------------------------------------


def training(args, remote: bool = False) -> dict:
  config = _config(path=args.path)
  tokens_per_step = config.train.global_batch * config.data.seq_len
  workdir = tempfile.mkdtemp(prefix="bench_serve_")
  if not remote:
    return _training(args, config, tokens_per_step, workdir, remote)
  if args.path == "unserialized":
    raise SystemExit(
      "--path=unserialized: remote workers on CPU run each operation to completion "
      "(backend/remote/server.py), so remote mode has only the serialized path here"
    )
  from pwtrain.backend.remote import auth, launcher  # the [remote] extra

  with launcher.launch([8]) as workers:  # one worker process of 8 devices serves the island
    os.environ[auth.TOKEN_ENV] = workers.token
    config.backend.mode, config.backend.workers = "remote", tuple(workers.addresses)
    try:
      return _training(args, config, tokens_per_step, workdir, remote)
    finally:
      del os.environ[auth.TOKEN_ENV]


def _build(config, args, trace=None):
  """The harness of `config` on --path (unserialized: execution serialization off)."""
  from pwtrain.harness import Harness

  serialize = False if args.path == "unserialized" else None
  if config.backend.mode == "remote":
    return Harness.build(config)
  return Harness.build(config, serialize_execution=serialize, trace=trace)


def _training(args, config, tokens_per_step, workdir, remote) -> dict:
  from pwtrain import serve

  with _build(config, args) as harness, serve.listening(config) as sock:
    state = harness.init()
    with serve.attached(config, harness.controller, lambda: harness, state, workdir, sock) as srv:
      trainer = Trainer(harness, state).start().started()
      _served_once(srv.url)
      time.sleep(args.warmup_s)
      island = harness.plan.islands[0].name
      blocks = {load: [] for load in LOADS}
      clock = (lambda: None) if remote else (lambda: harness.controller.island_time()[island])
      for block in range(args.blocks):
        # Each block rotates the loads' order, so that a drift of the machine's speed falls on
        # every load alike.
        for load in LOADS[block % len(LOADS) :] + LOADS[: block % len(LOADS)]:

          def during(start, end, before):
            after = clock()
            busy = {k: after[k] - before[k] for k in after} if after else {}
            return {"steps": trainer.steps_between(start, end), "busy": busy}

          _, extra, samples = _load_block(srv.url, load, args, during, at_start=clock)
          # Each completion's training steps finished while it waited for its first token: a
          # count in steps, which the machine's load moves far less than seconds.
          extra["waited"] = [trainer.steps_between(a, b) for a, b in samples["firsts"]]
          blocks[load].append({**extra, "block": block, "samples": samples})
          print(
            f"block {block} clients {load}: {extra['steps']} steps, busy {extra['busy']}, "
            f"{len(samples['ttft'])} completions, load {samples['load']:.2f}",
            flush=True,
          )
      trainer.stop()
  return _training_table(args, blocks, tokens_per_step, remote)


def _training_table(args, blocks: dict, tokens_per_step: int, remote: bool) -> dict:
  """Each load's row over all its blocks together (module doc), and every block's figures."""
  rows, per_block, out = [], [], {}
  seconds = lambda bs: sum(b["samples"]["seconds"] for b in bs)  # noqa: E731
  clean_step = seconds(blocks[0]) / max(sum(b["steps"] for b in blocks[0]), 1)
  for load, bs in blocks.items():
    steps = sum(b["steps"] for b in bs)
    busy = {k: sum(b["busy"].get(k, 0.0) for b in bs) for k in ("priority", "ordinary")}
    share = None if remote else busy["priority"] / max(busy["priority"] + busy["ordinary"], 1e-9)
    row = {
      "train_tokens_per_s": steps * tokens_per_step / seconds(bs),
      "ratio": steps / seconds(bs) / (1 / clean_step),
      "share": share,
      "step_s": seconds(bs) / max(steps, 1),
      **(_pooled([b["samples"] for b in bs]) if load else {}),
    }
    row["ttft_p50_steps"] = row.get("ttft_p50", float("nan")) / clean_step
    waited = [w for b in bs for w in b.get("waited", [])]
    row["waited_mean"] = statistics.mean(waited) if waited else float("nan")
    row["waited_p50"] = statistics.median(waited) if waited else float("nan")
    out[load] = row
    nan = float("nan")
    rows.append([load, row["train_tokens_per_s"], row["ratio"], nan if remote else share,
                 row.get("completions", 0), row.get("ttft_p50", nan), row.get("ttft_p99", nan),
                 row["ttft_p50_steps"], row.get("tpot_p50", nan), row.get("tpot_p99", nan),
                 row.get("tokens_per_s", 0.0), row["waited_p50"], row["waited_mean"]])  # fmt: skip
    for b in bs:
      clean = next(c for c in blocks[0] if c["block"] == b["block"])
      clean_s = clean["samples"]["seconds"] / max(clean["steps"], 1)
      one, step_s = _pooled([b["samples"]]), b["samples"]["seconds"] / max(b["steps"], 1)
      per_block.append([load, b["block"], b["steps"], step_s, len(b["samples"]["ttft"]),
                        one["ttft_p50"], one["ttft_p50"] / clean_s,
                        b["samples"]["load"]])  # fmt: skip
  mode = f"{'remote' if remote else 'embedded'}, {args.path} path"
  _print_table(
    f"training with the server attached ({mode}; each row: all {args.blocks} blocks together)",
    ["clients", "train tokens/s", "ratio", "serving share", "completions",
     "TTFT p50 s", "TTFT p99 s", "TTFT p50 / step", "TPOT p50 s", "TPOT p99 s", "output tokens/s",
     "steps waited p50", "steps waited mean"],
    rows,
  )  # fmt: skip
  _print_table(
    f"every block ({mode})",
    [
      "clients",
      "block",
      "steps",
      "step s",
      "completions",
      "TTFT p50 s",
      "TTFT p50 / its step",
      "load avg",
    ],
    per_block,
  )
  return {"mode": mode, "clean_step_s": clean_step, "by_clients": out, "blocks": per_block}


FLOOD_KINDS = ("none", "flood", "unbounded")


def flood(args) -> dict:
  """Serving's share of the island under a flood (module doc), by three clocks."""
  from pwtrain import serve
  from pwtrain.backend import Trace

  config = _config(path=args.path, **{"serve.share": args.share})
  tokens_per_step = config.train.global_batch * config.data.seq_len
  workdir = tempfile.mkdtemp(prefix="bench_serve_flood_")
  trace = Trace(record_completion=True)
  with _build(config, args, trace) as harness, serve.listening(config) as sock:
    state = harness.init()
    controller = harness.controller
    with serve.attached(config, controller, lambda: harness, state, workdir, sock) as srv:
      pieces = srv.engine._pieces
      programs = (pieces.init, *pieces.prefill.values(), pieces.decode, pieces.probe)
      serving = {n.name for p in programs for n in p.nodes}
      island = harness.plan.islands[0].name
      offset = time.monotonic() - trace.now()  # trace clock + offset = time.monotonic
      trainer = Trainer(harness, state).start().started()
      time.sleep(args.warmup_s)
      rows = []
      for block in range(args.blocks):
        for kind in FLOOD_KINDS[block % 3 :] + FLOOD_KINDS[: block % 3]:
          controller.set_priority_share(1.0 if kind == "unbounded" else args.share)

          def during(start, end, before):
            after = controller.island_time()[island]
            return {
              "steps": trainer.steps_between(start, end),
              "step_s": trainer.step_time(start, end),
              "policy": {k: after[k] - before[k] for k in after},
              "trace": _trace_busy(trace, island, serving, start - offset, end - offset),
            }

          clients = args.flood_clients if kind != "none" else 0
          _, extra, samples = _load_block(
            srv.url,
            clients,
            args,
            during,
            args.flood_tokens,
            lambda: controller.island_time()[island],
          )
          rows.append({**extra, "block": block, "kind": kind, "samples": samples})
          print(f"block {block} {kind}: {extra}, load {samples['load']:.2f}", flush=True)
      controller.set_priority_share(args.share)
      trainer.stop()
  return _flood_table(args, rows, tokens_per_step)


def _step_rate(rows: list[dict]) -> float:
  """Training steps per second over `rows`' blocks (Trainer.step_time); 0 with under 2 steps
  finished in every block (serving took the island)."""
  seconds = sum(r["step_s"][1] for r in rows)
  return sum(r["step_s"][0] for r in rows) / seconds if seconds else 0.0


def _trace_busy(trace, island: str, serving: set, start: float, end: float) -> dict:
  """{"priority", "ordinary", "idle"}: the seconds of [start, end) (the trace's clock) that
  `island` spent on serving's nodes, on the others and on nothing, from the trace's launch and
  completion stamps (the completion watcher's where execution is not serialized): a node runs
  from its launch or its predecessor's end, whichever is later, to its completion."""
  events = sorted(
    (e for e in list(trace.events) if e.island == island and e.launch is not None and e.done),
    key=lambda e: e.launch,
  )
  busy, prev = {"priority": 0.0, "ordinary": 0.0}, 0.0
  for e in events:
    begin = max(e.launch, prev)
    prev = max(prev, e.done)
    seconds = max(min(e.done, end) - max(begin, start), 0.0)
    busy["priority" if e.name in serving else "ordinary"] += seconds
  busy["idle"] = max(end - start - busy["priority"] - busy["ordinary"], 0.0)
  return busy


def _flood_table(args, rows: list[dict], tokens_per_step: int) -> dict:
  """Per kind over all blocks together, and per block: serving's share by the policy's clock,
  by the trace's intervals, and by training's loss of steps/s against the clean blocks."""

  def figures(group: list[dict], clean: list[dict]) -> dict:
    seconds = sum(r["samples"]["seconds"] for r in group)
    rate, clean_rate = _step_rate(group), _step_rate(clean)
    share = lambda busy: busy["priority"] / max(busy["priority"] + busy["ordinary"], 1e-9)  # noqa: E731
    total = lambda key: {
      k: sum(r[key].get(k, 0.0) for r in group) for k in ("priority", "ordinary", "idle")
    }  # noqa: E501, E731
    traced = total("trace")
    return {
      "train_tokens_per_s": rate * tokens_per_step,
      "share_policy": share(total("policy")),
      "share_trace": share(traced),
      "share_training_loss": 1 - rate / clean_rate if clean_rate else float("nan"),
      "busy_fraction": 1 - traced["idle"] / seconds,
      "output_tokens_per_s": sum(r["samples"]["tokens"] for r in group) / seconds,
      "completions": sum(len(r["samples"]["ttft"]) for r in group),
    }

  clean = [r for r in rows if r["kind"] == "none"]
  by_kind = {k: figures([r for r in rows if r["kind"] == k], clean) for k in FLOOD_KINDS}
  per_block = []
  for r in rows:
    f = figures([r], [c for c in clean if c["block"] == r["block"]])
    per_block.append([r["block"], r["kind"], f["train_tokens_per_s"], f["share_policy"],
                      f["share_trace"], f["share_training_loss"], f["busy_fraction"],
                      f["output_tokens_per_s"], r["samples"]["load"]])  # fmt: skip
  header = ["policy clock", "trace intervals", "1 - training ratio", "island busy",
            "output tokens/s"]  # fmt: skip
  title = (f"serving's share under a flood ({args.flood_clients} clients, {args.flood_tokens}-"
           f"token completions; serve.share={args.share}, unbounded: share 1.0; {args.path} "
           f"path; each row: all {args.blocks} blocks together)")  # fmt: skip
  _print_table(
    title,
    ["kind", "train tokens/s", *header, "completions"],
    [[k, f["train_tokens_per_s"], f["share_policy"], f["share_trace"], f["share_training_loss"],
      f["busy_fraction"], f["output_tokens_per_s"], f["completions"]]
     for k, f in by_kind.items()],
  )  # fmt: skip
  _print_table("every block", ["block", "kind", "train tokens/s", *header, "load avg"], per_block)
  return {"by_kind": by_kind, "blocks": per_block}


def _checkpointed(config, workdir: str, steps: int = 2) -> None:
  """A run's workdir with a checkpoint of `steps` random-batch steps, and its config.json."""
  import json

  from pwtrain.checkpoint import Checkpointer
  from pwtrain.harness import Harness

  with Harness.build(config) as harness:
    trainer = Trainer(harness, harness.init())
    for i, batch in enumerate(trainer.batches[:steps]):
      trainer.state = harness.step(trainer.state, batch, i).state
    state = {k: v.result() for k, v in trainer.state.items()}
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=3, every=1, async_save=False)
    ckpt.save(steps, harness.step_program.to_checkpoint(state), {"step": steps})
    ckpt.close()
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config.to_dict(), f)


def standalone(args) -> dict:
  from pwtrain import serve

  config = _config(**{"serve.reload": False})
  workdir = tempfile.mkdtemp(prefix="bench_serve_standalone_")
  _checkpointed(config, workdir)
  loads = [load for load in LOADS if load]
  blocks = {load: [] for load in loads}
  with serve.listening(config) as sock:
    server = serve.standalone(config, workdir, sock).start()
    try:
      for _ in range(args.blocks):
        for load in loads:
          blocks[load].append(_load_block(server.url, load, args)[0])
    finally:
      server.stop()
  for load in loads:  # each block's throughput against that block's one client
    for row, one in zip(blocks[load], blocks[1], strict=True):
      row["x_one_client"] = row["tokens_per_s"] / one["tokens_per_s"]
  medians = {load: _medians(rows) for load, rows in blocks.items()}
  rows = [[load, m["ttft_p50"], m["ttft_p99"], m["tpot_p50"], m["tpot_p99"], m["tokens_per_s"],
           m["x_one_client"]] for load, m in medians.items()]  # fmt: skip
  _print_table(
    "standalone (pwtrain.serve's server, nothing training; medians of blocks)",
    ["clients", "TTFT p50 s", "TTFT p99 s", "TPOT p50 s", "TPOT p99 s", "output tokens/s",
     "x 1 client"],
    rows,
  )  # fmt: skip
  return {"by_clients": medians}


def freshness(args) -> dict:
  import jax
  import numpy as np

  from pwtrain import serve
  from pwtrain.checkpoint import Checkpointer
  from pwtrain.harness import Harness

  config = _config(**{"serve.reload_poll_s": 0.5})
  workdir = tempfile.mkdtemp(prefix="bench_serve_fresh_")
  _checkpointed(config, workdir, steps=1)
  separate = subprocess.Popen(
    [sys.executable, "-m", "pwtrain.serve", f"--workdir={workdir}", "--port=0",
     "--config.serve.reload_poll_s=0.5"],
    stderr=subprocess.PIPE, text=True,
  )  # fmt: skip
  try:
    separate_url = _served_url(separate)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=3, every=1)
    with Harness.build(config) as harness, serve.listening(config) as sock:
      state = harness.init()
      before = serve.server.device_bytes()
      attach = serve.attached(config, harness.controller, lambda: harness, state, workdir, sock)
      with attach as srv:
        added = serve.server.device_bytes() - before
        cache = srv.engine.status()["cache_bytes"]
        trainer = Trainer(harness, state, every=args.checkpoint_every, checkpointer=ckpt).start()
        clients = {"attached": Clients(srv.url, 1, 16), "separate": Clients(separate_url, 1, 16)}
        time.sleep(args.freshness_s)
        records = {side: c.stop() for side, c in clients.items()}
        trainer.stop()
        stale = {
          side: [trainer.finished_at(r["times"][-1]) - r["step"] for r in rs]
          for side, rs in records.items()
        }
      ckpt.close()
    separate_bytes = _gauge(separate_url, "device_bytes")
    separate_cache = _gauge(separate_url, "kv_cache_bytes")
  finally:
    separate.terminate()
    separate.wait(timeout=60)
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["state"]["params"]))
  out = {
    side: {"mean": float(np.mean(v)), "p50": float(np.median(v)), "max": int(np.max(v)),
           "responses": len(v)}
    for side, v in stale.items()
  }  # fmt: skip
  out["memory"] = {
    "params_bytes": params,
    "attached_added_bytes": added,
    "attached_kv_cache_bytes": cache,
    "attached_weight_copies_bytes": added - cache,
    "separate_process_device_bytes": separate_bytes,
    "separate_kv_cache_bytes": separate_cache,
  }
  _print_table(
    f"freshness: steps behind the trainer at each response (checkpoint every "
    f"{args.checkpoint_every} steps)",
    ["server", "mean", "p50", "max", "responses"],
    [[side, v["mean"], v["p50"], v["max"], v["responses"]] for side, v in out.items()
     if side != "memory"],
  )  # fmt: skip
  _print_table("memory: device bytes serving adds", ["what", "bytes"], list(out["memory"].items()))
  return out


def pipeline(args) -> dict:
  from pwtrain import serve
  from pwtrain.harness import Harness

  out = {}
  for name in ("palm_tiny", "palm_tiny_pipeline"):
    config = _config(name)
    workdir = tempfile.mkdtemp(prefix="bench_serve_pipe_")
    with Harness.build(config) as harness, serve.listening(config) as sock:
      state = harness.init()
      with serve.attached(
        config, harness.controller, lambda h=harness: h, state, workdir, sock
      ) as srv:  # noqa: E501
        blocks = [_load_block(srv.url, 1, args)[0] for _ in range(args.blocks)]
        pieces = srv.engine._pieces
        nodes = sum(type(n).__name__ == "Node" for n in pieces.decode.nodes)
        transfers = len(pieces.decode.nodes) - nodes
    out[name] = {**_medians(blocks), "decode_nodes": nodes, "decode_transfers": transfers}
  base = out["palm_tiny"]["tpot_p50"]
  _print_table(
    "decode through a pipeline's stage islands (attached, idle run, 1 client)",
    ["config", "TPOT p50 s", "x one island", "nodes per token", "transfers per token"],
    [[k, v["tpot_p50"], v["tpot_p50"] / base, v["decode_nodes"], v["decode_transfers"]]
     for k, v in out.items()],
  )  # fmt: skip
  return out


def _served_once(url: str) -> None:
  """Waits for one completion, so that no block counts the server's start: a remote worker
  compiles the serving programs in the background (remote/server.py's Compile), and a first
  token comes once the engine's init, compiled last, has run."""
  import httpx

  body = {"prompt": "def main(", "max_tokens": 2}
  httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def _served_url(process) -> str:
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
  deadline = time.monotonic() + 600
  while time.monotonic() < deadline:
    try:
      line = lines.get(timeout=1)
    except queue.Empty:
      if process.poll() is not None:
        raise RuntimeError("pwtrain.serve exited") from None
      continue
    if found := re.search(r"serving the model at (http://\S+)/v1", line):
      return found.group(1)
  raise RuntimeError("pwtrain.serve did not start")


def _gauge(url: str, name: str) -> float:
  import httpx

  text = httpx.get(f"{url}/metrics").text
  return float(re.search(rf"^pwtrain_serve_{name} (\S+)$", text, re.M).group(1))


if __name__ == "__main__":
  main()
