"""A Pathways-style timeline of one pipelined training step: Perfetto trace JSON and a PNG Gantt.

Run (records a few steps of configs/palm_tiny_pipeline.py: 4 islands x 2 simulated CPU devices):
  python experiments/pipeline_timeline.py
  python experiments/pipeline_timeline.py --schedule=gpipe --microbatches=4
Draw an existing trace (e.g. from a training run with tracing on):
  python -m pwtrain.main --config=palm_tiny_pipeline --workdir=/tmp/pp \
      --config.train.num_steps=5 --config.backend.trace=True
  python experiments/pipeline_timeline.py --trace=/tmp/pp/trace.json
Options: --config, --set KEY=VALUE (any config key, repeatable), --schedule (gpipe|1f1b),
--microbatches, --steps (recorded steps), --step (which controller step to draw; default a
steady-state one), --out_dir (default /tmp/pwtrain_timeline), --concurrent (record with
Controller(serialize_execution=False)), --serialized (auto|yes|no, see below).

Recording. The step program is built exactly as pwtrain.train does and driven through a
`Controller(trace=Trace())` with the config's `backend.max_inflight_steps`, on random token
batches (no data pipeline); then `trace.write(<out_dir>/trace.json)` (open it in
https://ui.perfetto.dev), each transfer's source node beside it (trace.sources.json), and the
picture is drawn from those files, as with --trace.

The picture (<out_dir>/timeline.png): one row per island over the chosen step's time window.
Bars are the execute spans of Trace.to_chrome (a node starts when it was launched and the
island's previous node finished, and ends when its outputs were ready): forward F, backward B,
fused forward+loss+backward FB of the last stage, labelled by microbatch; zeros, emb, finish,
reduce, apply; and transfers (thin bars). A transfer's span in the trace starts when its
island's scheduler handed it to the runtime, which is as soon as its source node was
*launched*, so it also covers the wait for the source's data; the picture starts a transfer bar
when its source node finished (sources from trace.sources.json, else guessed from the
pipeline's names, e.g. act2.5 <- F1.5), so that waiting shows as white space: the bubble. Nodes
of neighbouring steps in the window are grey. Ticks above each row mark when the controller
dispatched (enqueued) the step's nodes for that island: the whole step is enqueued long before
it runs.

Serialized execution. On CPU, pwtrain's Controller runs one computation at a time over all
islands (serialize_execution, to avoid XLA CPU collective deadlocks) and stamps `launch` only
after the computation finished, so the trace's spans are slivers. Such traces are detected
(--serialized=auto: span time < 20% of wall time) and each node is drawn from the previous
launch stamp of any island (or its own dispatch, if later) to its own launch stamp.
"""

import argparse
import collections
import json
import os
import pathlib
import re
import statistics

import common

common.force_host_devices(8)

# kind -> (face colour, label); transfers get thin bars.
STYLE = {
  "F": ("#4C72B0", "forward F"),
  "B": ("#DD8452", "backward B"),
  "FB": ("#8172B3", "forward+backward FB (last stage)"),
  "zeros": ("#BBBBBB", "zeros (grad sums)"),
  "emb": ("#937860", "emb (tied-embedding grad half)"),
  "finish": ("#55A868", "finish (tie grads, norm)"),
  "apply": ("#C44E52", "apply (clip, optimizer)"),
  "enc": ("#8C8C8C", "reduce/enc (grad sum over pods, norm)"),
  "step": ("#64B5CD", "train step (single island)"),
  "xfer": ("#2CA02C", "transfer (from source ready)"),
  "other": ("#999999", "other"),
}
# Transfer names of pwtrain.parallel.pipeline ("1:act2.5", "0>1:g2", ...) and spmd ("batch_in").
TRANSFER = re.compile(r"^(act\d|grad\d|tok\d|tgt\d|emb\d+to\d|sq\d+to\d|stats|g\d+$|batch_in$)")
PREFIX = re.compile(r"^(?:\d+>)?(?:\d+:)?")  # pod prefix: "1:" or "0>1:" (from pod 0 to pod 1)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  common.add_config_args(p, default="palm_tiny_pipeline")
  p.add_argument("--schedule", choices=("gpipe", "1f1b", "zero_bubble"), default=None)
  p.add_argument("--microbatches", type=int, default=None)
  p.add_argument("--steps", type=int, default=4, help="training steps to record")
  p.add_argument("--step", type=int, default=None, help="controller step to draw")
  p.add_argument("--trace", default=None, help="draw this trace.json instead of recording")
  p.add_argument("--out_dir", default="/tmp/pwtrain_timeline")
  p.add_argument(
    "--concurrent",
    action="store_true",
    help="record with Controller(serialize_execution=False): islands overlap on CPU too",
  )
  p.add_argument(
    "--serialized",
    choices=("auto", "yes", "no"),
    default="auto",
    help="the trace comes from serialized execution (spans rebuilt from launch stamps)",
  )
  return p.parse_args(argv)


def record(config, num_steps: int, path: str, concurrent: bool = False):
  """Runs `num_steps` steps through a traced Controller; writes the Chrome trace and, beside it,
  each transfer's source node (`<path>.sources.json`). Returns (trace dict, sources)."""
  import jax

  from pwtrain.backend import Trace, Transfer
  from pwtrain.harness import Harness

  trace = Trace()
  serialize = False if concurrent else None
  with Harness.build(config, trace=trace, serialize_execution=serialize) as harness:
    side = common.Side(harness, common.random_batches(config, num_steps))
    side.run(num_steps)
    metrics = jax.device_get(side.last_metrics.result())
    program = harness.step_program.program
  # The completion watchers stamp `done` asynchronously; close() has joined them.
  trace.write(path)
  sources = {
    n.name: n.src[0] if isinstance(n.src, tuple) else None
    for n in program.nodes
    if isinstance(n, Transfer)
  }
  with open(sources_path(path), "w") as f:
    json.dump(sources, f, indent=0)
  print(f"recorded {num_steps} steps; last loss {float(metrics['loss']):.4f}; wrote {path}")
  return trace.to_chrome(), sources


def sources_path(trace_path: str) -> str:
  return str(pathlib.Path(trace_path).with_suffix(".sources.json"))


# -- reading and drawing a trace ----------------------------------------------------------------


def base_name(name: str) -> str:
  return PREFIX.sub("", name, count=1)


def kind_of(name: str, transfers=()) -> str:
  base = base_name(name)
  if name in transfers or TRANSFER.match(base):
    return "xfer"
  m = re.match(r"^(FB|F|B)\d+\.\d+$", base)
  if m:
    return m.group(1)
  for kind in ("zeros", "emb", "finish", "apply", "enc", "reduce"):
    if re.match(rf"^{kind}\d+$", base):
      return "enc" if kind == "reduce" else kind
  return "step" if base.startswith(("train_step", "step")) else "other"


def micro_of(name: str):
  base = base_name(name)
  m = re.match(r"^(?:FB|F|B|act|grad)\d+\.(\d+)$", base) or re.match(r"^(?:tok|tgt)(\d+)$", base)
  return int(m.group(1)) if m else None


def guess_source(name: str, names: set):
  """The node a pipeline transfer reads, from pwtrain.parallel.pipeline's naming, or None.

  Only for traces recorded elsewhere (e.g. by pwtrain.main); recording here saves the exact
  sources next to the trace.
  """
  pre = name[: len(name) - len(base_name(name))]
  base = base_name(name)
  if m := re.match(r"^act(\d+)\.(\d+)$", base):
    return f"{pre}F{int(m.group(1)) - 1}.{m.group(2)}"
  if m := re.match(r"^grad(\d+)\.(\d+)$", base):
    s, mb = int(m.group(1)) + 1, m.group(2)
    return f"{pre}B{s}.{mb}" if f"{pre}B{s}.{mb}" in names else f"{pre}FB{s}.{mb}"
  if m := re.match(r"^emb(\d+)to\d+$", base):
    return f"{pre}emb{m.group(1)}"
  if m := re.match(r"^sq(\d+)to\d+$", base):
    return (
      f"{pre}reduce{m.group(1)}"
      if f"{pre}reduce{m.group(1)}" in names
      else f"{pre}finish{m.group(1)}"
    )
  if base.startswith("stats"):  # the loss statistics: the last FB of the sending pod
    src_pre = f"{name.split('>')[0]}:" if ">" in name else pre
    fbs = [n for n in names if n.startswith(f"{src_pre}FB")]
    return max(fbs, key=lambda n: int(n.split(".")[1])) if fbs else None
  return None  # host inputs (tokens, targets), cross-pod gradients, other programs


def parse_chrome(trace: dict):
  """-> ({pid: island}, spans [dict], dispatches [dict]) in milliseconds."""
  islands, spans, dispatches = {}, [], []
  for e in trace["traceEvents"]:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      islands[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "X":
      t0 = e["ts"] / 1e3
      spans.append(
        {
          "name": e["name"],
          "pid": e["pid"],
          "step": e["args"]["step"],
          "start": t0,
          "end": t0 + e["dur"] / 1e3,
        }
      )
    elif e.get("ph") == "i":
      name = e["name"].removeprefix("dispatch ")
      dispatches.append(
        {"name": name, "pid": e["pid"], "step": e["args"]["step"], "t": e["ts"] / 1e3}
      )
  return islands, spans, dispatches


def correct_transfers(spans: list, sources: dict | None) -> None:
  """Starts each transfer when its source node finished (see module docstring).

  `sources`: transfer name -> source node name (None: a host input); None: guess from names.
  """
  by_step = collections.defaultdict(dict)
  for s in spans:
    by_step[s["step"]][s["name"]] = s
  for nodes in by_step.values():
    names = set(nodes)
    for s in nodes.values():
      if kind_of(s["name"], sources or ()) != "xfer":
        continue
      src = sources.get(s["name"]) if sources is not None else guess_source(s["name"], names)
      src = nodes.get(src)
      if src is not None:
        s["start"] = min(max(s["start"], src["end"]), s["end"])


def is_serialized(spans: list) -> bool:
  """Execution serialized across islands (pwtrain's CPU default) stamps `launch` after the
  computation ran, so the trace's execute spans are slivers: far less busy time than wall time."""
  wall = max(s["end"] for s in spans) - min(s["start"] for s in spans)
  return sum(s["end"] - s["start"] for s in spans) < 0.2 * wall


def rebuild_serialized(spans: list, dispatches: list) -> None:
  """One computation at a time, across all islands: each node ran from the previous node's
  launch stamp (or its own dispatch, if later) to its own launch stamp."""
  sent = {(d["name"], d["step"]): d["t"] for d in dispatches}
  previous = None
  for s in sorted(spans, key=lambda s: s["start"]):
    stamp = s["start"]  # max(launch, previous done on the island) = launch here
    start = sent.get((s["name"], s["step"]), stamp)
    if previous is not None:
      start = max(start, previous)
    s["start"], s["end"] = min(start, stamp), stamp
    previous = stamp


def pick_step(spans: list, transfers, requested=None) -> int:
  steps = sorted({s["step"] for s in spans})
  if requested is not None:
    if requested not in steps:
      raise ValueError(f"--step={requested} is not in the trace; it has steps {steps}")
    return requested
  # Steady state: not the init program (step 0) nor the first training step; with neighbours.
  runs = {s["step"] for s in spans if kind_of(s["name"], transfers) in ("F", "B", "FB", "step")}
  compute = [st for st in steps if st in runs]
  return compute[-2] if len(compute) >= 3 else compute[-1]


def summarize(islands, spans, dispatches, step: int, transfers, serialized: bool) -> dict:
  mine = [s for s in spans if s["step"] == step]
  t0, t1 = min(s["start"] for s in mine), max(s["end"] for s in mine)
  busy = {}
  for pid in sorted(islands):
    compute = [s for s in mine if s["pid"] == pid and kind_of(s["name"], transfers) != "xfer"]
    busy[islands[pid]] = sum(s["end"] - s["start"] for s in compute) / (t1 - t0)
  per_kind = collections.defaultdict(list)
  for s in mine:
    per_kind[(islands[s["pid"]], kind_of(s["name"], transfers))].append(s["end"] - s["start"])
  sent = [d["t"] for d in dispatches if d["step"] == step]
  return {
    "step": step,
    "serialized": serialized,
    "step_ms": t1 - t0,
    "num_nodes": len(sent),
    "dispatch_ms": max(sent) - min(sent),  # first to last enqueue of the step's nodes
    "dispatch_lead_ms": t0 - max(sent),  # > 0: the whole step was enqueued before it ran
    "busy_fraction": busy,
    "median_ms": {f"{i}/{k}": statistics.median(v) for (i, k), v in sorted(per_kind.items())},
  }


def draw(trace: dict, png: str, step=None, title: str = "", sources=None, serialized="auto"):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  islands, spans, dispatches = parse_chrome(trace)
  transfers = set(sources or ())
  serial = is_serialized(spans) if serialized == "auto" else serialized == "yes"
  if serial:
    rebuild_serialized(spans, dispatches)
    title += "serialized execution (spans rebuilt from launch stamps); "
  else:
    correct_transfers(spans, sources)
  step = pick_step(spans, transfers, step)
  summary = summarize(islands, spans, dispatches, step, transfers, serial)
  mine = [s for s in spans if s["step"] == step]
  sent = [d for d in dispatches if d["step"] == step]
  origin = min(s["start"] for s in mine)
  hi = max(s["end"] for s in mine) - origin
  first_sent = min(d["t"] for d in sent) - origin
  # The step was dispatched while earlier steps ran; show at most 40% of a step before it.
  lo = max(min(first_sent, 0.0), -0.4 * hi)
  pad = 0.02 * (hi - lo)
  lo, hi = lo - pad, hi + pad

  pids = sorted(islands)
  row = {pid: len(pids) - 1 - i for i, pid in enumerate(pids)}  # island0 on top
  fig, ax = plt.subplots(figsize=(16, 1.2 + 1.25 * len(pids)))
  used = set()
  for s in spans:
    a, b = s["start"] - origin, s["end"] - origin
    if b < lo or a > hi:
      continue
    kind, y = kind_of(s["name"], transfers), row[s["pid"]]
    ours = s["step"] == step
    height, base = (0.22, y - 0.38) if kind == "xfer" else (0.55, y - 0.12)
    color = STYLE[kind][0] if ours else "#E3E3E3"
    edge = "white" if ours else "#C8C8C8"
    ax.broken_barh(
      [(a, max(b - a, 1e-3))], (base, height), facecolors=color, edgecolors=edge, lw=0.5
    )
    if ours:
      used.add(kind)
    label = None
    if kind in ("F", "B", "FB"):
      label = str(micro_of(s["name"]))
    elif kind in ("finish", "apply", "step"):
      label = {"finish": "fin", "apply": "apply", "step": "step"}[kind]
    if label and ours and (b - a) > 0.012 * (hi - lo) * len(label):
      ax.text(
        (a + b) / 2, base + height / 2, label, ha="center", va="center", fontsize=7, color="white"
      )
  for d in sent:
    y = row[d["pid"]]
    ax.vlines(max(d["t"] - origin, lo), y + 0.47, y + 0.6, color="black", lw=0.6)
  ax.set_yticks([row[p] for p in pids])
  count = collections.Counter(d["pid"] for d in sent)
  ax.set_yticklabels(
    [
      f"{islands[p]}\nbusy {summary['busy_fraction'][islands[p]]:.0%}\n{count[p]} nodes"
      for p in pids
    ],
    fontsize=9,
  )
  ax.set_ylim(-0.55, len(pids) - 0.3)
  ax.set_xlim(lo, hi)
  ax.set_xlabel(f"ms from the first node of step {step} (grey: neighbouring steps)")
  ax.axvline(0, color="black", lw=0.5, ls=":")
  ax.axvline(summary["step_ms"], color="black", lw=0.5, ls=":")
  handles = [Patch(color=STYLE[k][0], label=STYLE[k][1]) for k in STYLE if k in used]
  handles.append(plt.Line2D([], [], color="black", lw=0.8, label="dispatched (controller enqueue)"))
  handles.append(Patch(color="#E3E3E3", label="neighbouring steps"))
  ax.legend(
    handles=handles,
    loc="upper center",
    bbox_to_anchor=(0.5, -0.16),
    ncol=5,
    fontsize=8,
    frameon=False,
  )
  ax.set_title(
    f"{title}step {step}: {summary['step_ms']:.1f} ms\nits {len(sent)} nodes were dispatched "
    f"{-first_sent:.0f} to {summary['dispatch_lead_ms']:.0f} ms before its first node ran "
    "(ticks above the rows; clipped at the left edge)",
    fontsize=10,
  )
  note = (
    "Serialized execution (one computation at a time over all islands, pwtrain's CPU default): "
    "each bar runs from the previous launch stamp (or its dispatch) to its own launch stamp."
    if serial
    else "Bars: execute spans from Trace.to_chrome (start = max(launch, previous node on the "
    "island done), end = outputs ready). On CPU the controller runs one computation at a time, "
    "so spans are exact and islands never overlap; without serialization, a node whose outputs "
    "are all donated onward gets only a lower bound for its completion."
  )
  fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
  ax.grid(axis="x", color="#EEEEEE")
  ax.set_axisbelow(True)
  fig.tight_layout(rect=(0, 0.03, 1, 1))
  fig.savefig(png, dpi=130)
  plt.close(fig)
  return summary


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  png = os.path.join(args.out_dir, "timeline.png")
  if args.trace:
    with open(args.trace) as f:
      trace = json.load(f)
    sources = None
    if os.path.exists(sources_path(args.trace)):
      with open(sources_path(args.trace)) as f:
        sources = json.load(f)
    title = f"{args.trace}; "
  else:
    overrides = common.parse_sets(args.set)
    if args.schedule:
      overrides["parallel.schedule"] = args.schedule
    if args.microbatches:
      overrides["train.num_microbatches"] = args.microbatches
    config = common.load_config(args.config, overrides)
    path = os.path.join(args.out_dir, "trace.json")
    trace, sources = record(config, args.steps, path, args.concurrent)
    title = (
      f"{pathlib.Path(args.config).stem}: {config.parallel.stages} stages, "
      f"{config.parallel.schedule}, M={config.train.num_microbatches}, "
      f"batch {config.train.global_batch}x{config.data.seq_len}; "
    )
  summary = draw(trace, png, args.step, title, sources, args.serialized)
  print(
    f"step {summary['step']}: {summary['step_ms']:.1f} ms; {summary['num_nodes']} nodes "
    f"dispatched in {summary['dispatch_ms']:.1f} ms, the last {summary['dispatch_lead_ms']:.0f} "
    "ms before the step's first node started"
  )
  for island, frac in summary["busy_fraction"].items():
    print(f"  {island}: busy {frac:.0%} (compute nodes, transfers excluded)")
  for key, ms in summary["median_ms"].items():
    print(f"  median {key}: {ms:.2f} ms")
  with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {png}")
  return summary


if __name__ == "__main__":
  main()
