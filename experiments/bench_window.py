"""The launch window (backend.launch_window) on the unserialized path: training throughput with a
window of 1, 2 and 4 against unbounded (0), and how long a priority program waits behind the
training steps, side by side in one run.

One island of one device, serialized execution off (the path GPUs and TPUs take; on CPU, one
device per island so that XLA's CPU collectives cannot deadlock). A PaLM decoder trains with
AdamW, the controller running ahead by `--max_inflight` programs as the trainer does
(backend.max_inflight_steps: with 1, the trainer's default, at most 2 steps are in flight, so a
window of 2 or more equals unbounded there; `--max_inflight=4` shows what a window holds back).
For each window, every repeat:

  throughput  `--steps` training steps alone, timed from the first dispatch to the last one's
              loss on the host: steps per second, and its ratio to unbounded in the same repeat.
  wait        the same steps again while a priority client (serving's shape: a forward of
              `--probe_tokens` tokens reading the live parameters in place, program.Latest)
              dispatches one program at a time every `--probe_every` step times: each one's
              latency from dispatch to its logits being ready, less its own run time alone,
              in training step times (p50, p90), and the training throughput meanwhile.

One controller runs every measurement (the window set between them, Controller.
set_launch_window), the windows in a rotated order in each repeat, so that a drift of the
machine's speed falls on every window alike; every repeat is printed and kept in the JSON, not
only the median.

It imports JAX, Flax, Optax and pwtrain's backend and models only (no data pipeline, no config
library): it runs on an image with JAX for its accelerator and nothing else of pwtrain's
dependencies. Sizes: `--size=cpu` (a 2-layer d_model 128 model, steps of milliseconds) or
`--size=gpu` (8 layers, d_model 1024, batch 8 x 1024 tokens: about 130M parameters, steps of tens
of milliseconds on a recent GPU), or each dimension by its own flag.

  python experiments/bench_window.py --size=cpu
  python experiments/bench_window.py --size=gpu --json=/tmp/window.json
  python experiments/bench_window.py --size=cpu --max_inflight=4 --no_waits --repeats=30

The summary gives, per window, the median and quartiles of the repeats' ratios to unbounded and
the pooled ratio (all its blocks' steps over all their time, against unbounded's).
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

SIZES = {  # layers, d_model, heads, head_dim, d_ff, vocab, batch, seq
  "cpu": dict(layers=2, d_model=128, heads=4, head_dim=32, d_ff=512, vocab=512, batch=4, seq=64),
  "gpu": dict(
    layers=8, d_model=1024, heads=16, head_dim=64, d_ff=4096, vocab=32768, batch=8, seq=1024
  ),
}


class ModelConfig(dict):
  """The model section as pwtrain's decoder reads it (attributes and `get`), without the config
  library: the keys of `model.*` in pwtrain/defaults.py that the decoder needs."""

  __getattr__ = dict.__getitem__


def model_config(size: dict) -> ModelConfig:
  return ModelConfig(
    family="palm",
    vocab_size=size["vocab"],
    num_layers=size["layers"],
    d_model=size["d_model"],
    num_heads=size["heads"],
    num_kv_heads=1,
    head_dim=size["head_dim"],
    d_ff=size["d_ff"],
    rope_base=10000.0,
    dtype="bfloat16" if size.get("bf16") else "float32",
    param_dtype="float32",
    remat="none",
    scan_layers=False,
    attention="einsum",
  )


def build(controller, cluster, cfg, size: dict, probe_tokens: int):
  """The training step and the probe as programs on island0, and the first train state there."""
  import jax
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  from pwtrain.backend import Node, Program
  from pwtrain.models.palm import PaLM, lm_loss

  island = "island0"
  replicated = NamedSharding(cluster[island].mesh({"d": 1}), PartitionSpec())
  model = PaLM(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adamw(1e-4)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    loss, stats = lm_loss(logits, tokens[:, 1:])
    return loss / stats["tokens"]

  def step(state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  def probe(state, tokens):
    return nnx.merge(graphdef, state["params"])(tokens)[:, -1]

  state = jax.device_put({"params": params, "opt": tx.init(params)}, replicated)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state
  )
  rng = np.random.default_rng(0)
  tokens = jax.device_put(
    rng.integers(0, size["vocab"], (size["batch"], size["seq"] + 1), dtype=np.int32), replicated
  )
  prompt = jax.device_put(
    rng.integers(0, size["vocab"], (1, probe_tokens), dtype=np.int32), replicated
  )
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
  step_exe = controller.compile(
    "step", step, island, (abstract, spec(tokens)), out_shardings=replicated, donate_argnums=(0,)
  )
  params_only = {"params": abstract["params"]}
  probe_exe = controller.compile(
    "probe", probe, island, (params_only, spec(prompt)), out_shardings=replicated
  )
  controller.wait_compiles()
  train = Program(
    (Node("step", step_exe, ("state", "tokens")),),
    {"state": ("step", 0), "loss": ("step", 1)},
    ("state",),
  )
  read = Program((Node("probe", probe_exe, ("state", "prompt")),), {"logits": ("probe", 0)})
  return train, read, state, tokens, prompt


class Bench:
  """One controller, one island, the programs compiled once; `measure(window)` sets the window
  (Controller.set_launch_window) and gives its row (module doc)."""

  def __init__(self, args, size: dict, cfg):
    import jax

    from pwtrain.backend import Cluster, Controller
    from pwtrain.backend.program import Latest

    self.args = args
    cluster = Cluster.local([1])
    self.controller = Controller(cluster, max_inflight=args.max_inflight, serialize_execution=False)
    self.controller.start_publishing()
    self.train, self.read, self.state, self.tokens, prompt = build(
      self.controller, cluster, cfg, size, args.probe_tokens
    )
    self.latest = {"state": Latest("state", ("params",)), "prompt": prompt}
    self.steps(args.warmup)  # compiled, warm; the state published
    solo = []
    for _ in range(5):  # the probe's own run time, alone on an idle island
      t = time.perf_counter()
      jax.block_until_ready(self.probe())
      solo.append(time.perf_counter() - t)
    self.probe_s = statistics.median(solo)

  def probe(self):
    return self.controller.run(self.read, self.latest, priority=True)["logits"].result()

  def steps(self, n: int) -> float:
    """Seconds from the first of `n` steps' dispatch to the last one's loss on the host."""
    import jax

    start = time.perf_counter()
    loss = None
    for _ in range(n):
      out = self.controller.run(self.train, {"state": self.state, "tokens": self.tokens})
      self.state, loss = out["state"], out["loss"]
    jax.device_get(loss.result())
    return time.perf_counter() - start

  def measure(self, window: int) -> dict:
    import jax

    args = self.args
    self.controller.set_launch_window(window)
    self.steps(2)
    seconds = self.steps(args.steps)
    step_s = seconds / args.steps
    if args.no_waits:  # throughput blocks only
      return {"window": window, "steps_per_s": args.steps / seconds, "step_ms": 1e3 * step_s,
              "steps_per_s_serving": float("nan"), "probe_ms": 1e3 * self.probe_s, "probes": 0,
              "wait_p50_steps": float("nan"), "wait_p90_steps": float("nan")}  # fmt: skip
    waits, stop = [], threading.Event()

    def client():
      while not stop.wait(args.probe_every * step_s):
        t = time.perf_counter()
        jax.block_until_ready(self.probe())
        waits.append((time.perf_counter() - t - self.probe_s) / step_s)

    thread = threading.Thread(target=client)
    thread.start()
    serving_seconds = self.steps(args.steps)
    stop.set()
    thread.join()
    waits.sort()
    pick = lambda q: waits[min(int(q * len(waits)), len(waits) - 1)] if waits else float("nan")  # noqa: E731
    return {
      "window": window,
      "steps_per_s": args.steps / seconds,
      "step_ms": 1e3 * step_s,
      "steps_per_s_serving": args.steps / serving_seconds,
      "probe_ms": 1e3 * self.probe_s,
      "probes": len(waits),
      "wait_p50_steps": pick(0.5),
      "wait_p90_steps": pick(0.9),
    }

  def close(self):
    self.controller.close()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
  for key in SIZES["cpu"]:
    parser.add_argument(f"--{key}", type=int, default=None, help=f"overrides the size's {key}")
  parser.add_argument("--bf16", action="store_true", help="bfloat16 activations")
  parser.add_argument("--windows", default="1,2,4,0", help="launch windows (0: unbounded)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--steps", type=int, default=50, help="timed steps per measurement")
  parser.add_argument("--warmup", type=int, default=10)
  parser.add_argument("--max_inflight", type=int, default=1, help="backend.max_inflight_steps")
  parser.add_argument("--probe_tokens", type=int, default=64)
  parser.add_argument("--probe_every", type=float, default=2.5, help="in step times")
  parser.add_argument(
    "--no_waits", action="store_true", help="throughput blocks only (no priority client)"
  )
  parser.add_argument("--json", default="", help="also write the rows here")
  args = parser.parse_args(argv)
  if args.size == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  size = dict(SIZES[args.size], bf16=args.bf16)
  for key in SIZES["cpu"]:
    if getattr(args, key) is not None:
      size[key] = getattr(args, key)
  cfg = model_config(size)
  windows = [int(w) for w in args.windows.split(",")]
  import jax

  print(f"# {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax {jax.__version__}, "
        f"size {size}, max_inflight {args.max_inflight}, {args.steps} steps per measurement",
        flush=True)  # fmt: skip
  print("repeat window  steps/s  step_ms  vs_unbounded  steps/s_serving  probe_ms  probes  "
        "wait_p50  wait_p90", flush=True)  # fmt: skip
  rows = []
  bench = Bench(args, size, cfg)
  for repeat in range(args.repeats):
    order = windows[repeat % len(windows) :] + windows[: repeat % len(windows)]
    measured = {w: bench.measure(w) for w in order}
    for w in windows:
      row = dict(measured[w], repeat=repeat)
      base = measured.get(0)
      row["vs_unbounded"] = row["steps_per_s"] / base["steps_per_s"] if base else float("nan")
      rows.append(row)
      print(f"{repeat:6d} {w:6d} {row['steps_per_s']:8.1f} {row['step_ms']:8.2f} "
            f"{row['vs_unbounded']:13.3f} {row['steps_per_s_serving']:16.1f} "
            f"{row['probe_ms']:9.2f} {row['probes']:7d} {row['wait_p50_steps']:9.2f} "
            f"{row['wait_p90_steps']:9.2f}",
            flush=True)  # fmt: skip
  print(
    f"# over {args.repeats} repeats: throughput vs unbounded, median [25%, 75%] of the "
    "repeats' ratios, and pooled (all blocks' steps / all their time, against unbounded's)"
  )
  pooled_base = _pooled_rate([r for r in rows if r["window"] == 0], args.steps)
  for w in windows:
    mine = [r for r in rows if r["window"] == w]
    ratios = [r["vs_unbounded"] for r in mine]
    q1, q2, q3 = (
      statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    )
    pooled = _pooled_rate(mine, args.steps) / pooled_base if pooled_base else float("nan")
    med = {k: statistics.median(r[k] for r in mine) for k in ("wait_p50_steps", "wait_p90_steps")}
    print(f"window {w}: throughput vs unbounded {q2:.3f} [{q1:.3f}, {q3:.3f}], pooled "
          f"{pooled:.3f}; priority wait p50 {med['wait_p50_steps']:.2f} p90 "
          f"{med['wait_p90_steps']:.2f} steps")  # fmt: skip
  bench.close()
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"argv": sys.argv, "size": size, "rows": rows}, f, indent=1)


def _pooled_rate(rows: list[dict], steps: int) -> float:
  """Steps per second over all of `rows`' blocks together."""
  return len(rows) * steps / sum(steps / r["steps_per_s"] for r in rows) if rows else 0.0


if __name__ == "__main__":
  main()
