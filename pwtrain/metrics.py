"""Step metrics: a progress bar, TensorBoard events, a JSONL file in the workdir, and optionally
Weights & Biases.

Metrics arrive as futures of device arrays. They are fetched only every `log_every` steps, in
one batch, so logging never makes the controller wait for each step's results.

The workdir's logs hold one row per step of the run's one trajectory: when a run resumes from
step N, or rolls back to it, the rows of steps after N (steps that will run again) are moved from
metrics.jsonl to metrics.rolled_back.jsonl (kept, not deleted), and TensorBoard is told to purge
its events of those steps (`purge_step`). The steps a resume so runs again (an earlier start
trained and logged them, then stopped before its next checkpoint) are badput, `rerun`: each
interval moves the productive time of its re-run steps there (goodput.py). With elastic pods
(rows with `pods_live`), the time steps take while pods are lost beyond the productive time per
step of the intervals with every pod live (the clean step time; the first interval, warming up,
left out) is badput, `degraded`.

Evaluation rows ({"step", "eval_loss", "eval_perplexity", "eval_bits_per_byte", ...}) go to the
same file, after the step's own rows, and to TensorBoard under eval/.

Every write happens on the caller's thread (TensorBoard's too: events.py), and one the storage
refuses (a full disk, a quota, a file size limit, an I/O error: any OSError) raises
`errors.WriteFailed`, naming the file, once; the logger writes nothing more, and train.py stops
the run there in one line. A row that write cut short is set aside on the next start
(`set_aside_torn`).
"""

import contextlib
import json
import logging
import math
import os
import time
from typing import Any

import jax
import numpy as np
import tqdm

from pwtrain import goodput as goodput_lib
from pwtrain.errors import WriteFailed
from pwtrain.events import Events

log = logging.getLogger(__name__)

PROGRESS = ("auto", "bar", "lines", "none")  # --progress: how the console shows training

# Peak dense bf16 FLOP/s per device, for MFU. Devices not listed (e.g. CPU) report no MFU.
PEAK_FLOPS = {
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,
  "TPU v5": 459e12,
  "NVIDIA H100 80GB HBM3": 989e12,
  "NVIDIA H200": 989e12,
  "NVIDIA A100-SXM4-80GB": 312e12,
}


def peak_flops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for name, flops in PEAK_FLOPS.items():
    if kind.startswith(name):
      return flops
  return None


def eval_metrics(sums: dict, num_bytes: int) -> dict[str, float]:
  """Eval loss (mean cross-entropy per real target, in nats; without the z-loss), perplexity
  exp(loss), and bits per byte: the summed cross-entropy in bits over the UTF-8 bytes of text
  the targets stand for (comparable across tokenizers)."""
  tokens = max(sums["tokens"], 1.0)
  loss = sums["ce_sum"] / tokens
  out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
  if num_bytes:
    out["eval_bits_per_byte"] = sums["ce_sum"] / math.log(2) / num_bytes
  out["eval_tokens"] = sums["tokens"]
  return out


class MetricsLogger:
  def __init__(
    self,
    workdir: str,
    *,
    start_step: int,
    num_steps: int,
    log_every: int,
    tokens_per_step: int,
    flops_per_token: float,
    num_devices: int,
    peak_flops_per_device: float | None,
    exchange_bytes_per_step: int = 0,
    progress: str = "bar",
    wandb_run: Any = None,
    goodput: Any = None,
    devices: tuple = (),
  ):
    """`progress`: "bar" (tqdm, for a terminal), "lines" (one plain line per interval on
    stdout, for a log file) or "none". `wandb_run`: a started W&B run (see `wandb_run.start`) that
    gets every row too, or None. `goodput`: the run's goodput.Goodput, whose fractions every
    interval row carries; `devices`: those whose peak memory it reports (goodput.memory_row)."""
    self.wandb = wandb_run
    self.exchange_bytes = exchange_bytes_per_step
    self.log_every = log_every
    self.tokens_per_step = tokens_per_step
    self.num_steps = num_steps
    self.tokens_per_s: float | None = None  # of the last log interval
    self.flops_per_token = flops_per_token
    self.peak = peak_flops_per_device * num_devices if peak_flops_per_device else None
    self._pending: list[tuple[int, object]] = []
    self._host: dict[int, dict] = {}  # step -> its host metrics (`record`)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb_dir = os.path.join(workdir, "tensorboard")
    self.failed = False  # a write was refused (WriteFailed): nothing more is written
    self._jsonl, self._tb, earlier = self._open_from(start_step)
    # Steps after the start that an earlier start trained and logged: they run again.
    self.rerun_through = max((r["step"] for r in earlier if "loss" in r), default=start_step)
    self.progress = progress
    self._bar = tqdm.tqdm(
      total=num_steps,
      initial=start_step,
      disable=progress != "bar",
      unit="step",
      dynamic_ncols=True,
    )
    self.goodput = goodput
    self._productive = goodput.productive_s() if goodput is not None else 0.0  # at the last flush
    self.devices = devices
    self._start_time = self._last_time = time.perf_counter()
    self._start_step = self._last_step = start_step
    self._data_wait = 0.0  # seconds waiting for batches in this interval
    self._step_time_s = 0.0
    self._clean = [0.0, 0]  # productive seconds and steps of intervals with every pod live
    self._most_live = 0  # the most pods live in a row so far (every pod, at the start)
    self._intervals = 0
    self.steps_run = 0  # steps of the kept trajectory logged by this start
    self.history: list[dict] = []
    self.evals: list[dict] = []  # one row per evaluation: {"step", "eval_loss", ...}

  @property
  def step_time_s(self) -> float:
    """The last interval's seconds per step (0 before the first)."""
    return self._step_time_s

  def add_data_wait(self, seconds: float) -> None:
    self._data_wait += seconds

  def record_once(self, step: int, **values) -> None:
    """A row of its own, e.g. {"compile_s"} (the time to the first step), once per start."""
    self._write([{"step": step, **values}])
    self._scalars({f"perf/{k}": x for k, x in values.items()}, step)

  def record(self, step: int, metrics_future, host: dict | None = None) -> None:
    """`step` is the step number after the update (1-based); `host`: metrics of the step known
    on the host (an RL step's rollouts: rl/rollouts.py), written into its row too."""
    self._pending.append((step, metrics_future))
    if host:
      self._host[step] = dict(host)
    if step % self.log_every == 0:
      self.flush()

  def flush(self) -> None:
    if not self._pending:
      return
    steps = [s for s, _ in self._pending]
    values = jax.device_get([f.result() if hasattr(f, "result") else f for _, f in self._pending])
    self._pending.clear()
    now = time.perf_counter()
    elapsed = max(now - self._last_time, 1e-9)
    done = steps[-1] - self._last_step
    tokens_per_s = done * self.tokens_per_step / elapsed
    self._last_time, self._last_step = now, steps[-1]
    for step, v in zip(steps, values, strict=True):
      row = {"step": step, **{k: float(np.asarray(x)) for k, x in v.items()}}
      row.update(self._host.pop(step, {}))
      self.history.append(row)
    rows = self.history[-len(steps) :]
    self.tokens_per_s = tokens_per_s
    self.steps_run += done
    speed = {"tokens_per_s": tokens_per_s, "steps_per_s": done / elapsed}
    speed["model_tflops_per_s"] = tokens_per_s * self.flops_per_token / 1e12
    if self.exchange_bytes:
      speed["exchange_bytes_per_step"] = self.exchange_bytes
    if self.peak:
      speed["mfu"] = tokens_per_s * self.flops_per_token / self.peak
    speed["time"] = time.time()
    speed["elapsed_s"] = now - self._start_time
    speed["step_time_s"] = self._step_time_s = elapsed / max(done, 1)
    speed["data_wait_s"], self._data_wait = self._data_wait, 0.0
    speed.update(goodput_lib.memory_row(self.devices) if self.devices else {})
    if self.goodput is not None:
      self._count_badput(rows, now)
      speed.update(self.goodput.row(now))
    self._write([*rows, {"step": steps[-1], **speed}])
    for row in rows:
      self._scalars({f"train/{k}": x for k, x in row.items() if k != "step"}, row["step"])
    self._scalars({f"perf/{k}": x for k, x in speed.items()}, steps[-1], flush=True)
    if self.wandb is not None:
      for row in rows:
        self._to_wandb(row, "train")
      self._to_wandb({"step": steps[-1], **speed}, "perf")
    self._bar.update(done)
    self._show()
    if self.progress == "lines":
      print(self._line(steps[-1], speed), flush=True)

  def _count_badput(self, rows: list[dict], now: float) -> None:
    """Moves the share of this interval's productive time that went to steps an earlier start
    had already trained (`rerun_through`) to the `rerun` badput, and, with elastic pods, what
    its steps with pods lost took beyond the clean step time to the `degraded` badput."""
    per_step = (self.goodput.productive_s(now) - self._productive) / len(rows)
    rerun = sum(1 for row in rows if row["step"] <= self.rerun_through)
    if rerun:
      self.goodput.add("rerun", per_step * rerun)
    live = [
      row["pods_live"] for row in rows if "pods_live" in row and row["step"] > self.rerun_through
    ]
    self._intervals += 1
    if live:
      self._most_live = max(self._most_live, *live)
      degraded = sum(1 for n in live if n < self._most_live)
      if not degraded and self._intervals > 1:
        self._clean[0] += per_step * len(live)
        self._clean[1] += len(live)
      elif degraded and self._clean[1]:
        clean = self._clean[0] / self._clean[1]
        self.goodput.add("degraded", max(per_step - clean, 0.0) * degraded)
    self._productive = self.goodput.productive_s(now)

  def _line(self, step: int, speed: dict) -> str:
    """One plain progress line: the local time (a log file's lines say when), step/total, loss,
    tokens/s, MFU, step time, ETA, memory."""
    parts = [f"{time.strftime('%Y-%m-%d %H:%M:%S')} step {step}/{self.num_steps}"]
    if self.history and "loss" in self.history[-1]:
      parts.append(f"loss {self.history[-1]['loss']:.4f}")
    parts.append(f"{speed['tokens_per_s']:,.0f} tokens/s")
    if "mfu" in speed:
      parts.append(f"MFU {100 * speed['mfu']:.1f}%")
    parts.append(f"step {speed['step_time_s']:.3f} s")
    eta = (self.num_steps - step) * speed["step_time_s"]
    parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
    memory = speed.get("memory_bytes", speed.get("host_rss_bytes"))
    if memory is not None:
      where = "device" if "memory_bytes" in speed else "host RSS"
      parts.append(f"memory {memory / 2**20:,.0f} MiB ({where})")
    return " | ".join(parts)

  def average_tokens_per_s(self) -> float | None:
    """Tokens per second over this start's steps, from the first to the last logged."""
    seconds = self._last_time - self._start_time
    return self.steps_run * self.tokens_per_step / seconds if self.steps_run and seconds else None

  def record_eval(self, step: int, values: dict[str, float]) -> None:
    """Logs an evaluation of the state after step `step` (eval_metrics' dict)."""
    self.flush()  # the step's own rows first
    row = {"step": step, **values}
    self.evals.append(row)
    self._write([row])
    self._scalars({f"eval/{k.removeprefix('eval_')}": x for k, x in values.items()}, step, True)
    if self.wandb is not None:
      self._to_wandb(row, "eval")
    self._show()

  def _write(self, rows: list[dict]) -> None:
    """Appends `rows` to metrics.jsonl, flushed (nothing once a write failed)."""
    if not self.failed:
      with self._writing(self.path):
        self._jsonl.write("".join(json.dumps(row) + "\n" for row in rows))
        self._jsonl.flush()

  def _scalars(self, tags: dict[str, float], step: int, flush: bool = False) -> None:
    """Adds {tag: value} of `step` to TensorBoard's events; `flush`: written to the disk."""
    if not self.failed:
      with self._writing(self._tb.path):
        for tag, x in tags.items():
          self._tb.add_scalar(tag, x, step)
        if flush:
          self._tb.flush()

  @contextlib.contextmanager
  def _writing(self, path: str):
    """A write of `path`: an OSError is `WriteFailed` naming it (or the file it names), and
    nothing more is written."""
    try:
      yield
    except OSError as e:
      self.failed = True
      raise WriteFailed(e.filename or path, e) from None

  def _show(self) -> None:
    postfix = {}
    if self.history:
      postfix["loss"] = f"{self.history[-1]['loss']:.4f}"
    if self.evals:
      postfix["eval_loss"] = f"{self.evals[-1]['eval_loss']:.4f}"
    if self.tokens_per_s:
      postfix["tok_s"] = f"{self.tokens_per_s:,.0f}"
    self._bar.set_postfix(postfix, refresh=False)
    self._bar.refresh()

  def _to_wandb(self, row: dict, section: str) -> None:
    values = {f"{section}/{k.removeprefix('eval_')}": v for k, v in row.items() if k != "step"}
    self.wandb.log({"step": row["step"], **values})

  def _open_from(self, step: int):
    """Opens the logs to continue after `step`: torn rows and later rows set aside (the later
    returned, as dicts), later events purged."""
    set_aside_torn(self.path)
    later = set_aside_after(self.path, step)
    return open(self.path, "a"), Events(self._tb_dir, purge_step=step + 1), later

  def rewind(self, step: int, **event) -> None:
    """After a rollback to `step`: log the event; rates and the bar restart from there."""
    self.flush()
    self._jsonl.close()
    self._tb.close()
    with self._writing(self.path):  # metrics.jsonl rewritten, the later rows set aside
      self._jsonl, self._tb, _ = self._open_from(step)  # train.py counts the abandoned steps
    self.rerun_through = min(self.rerun_through, step)
    self._write([{"step": step, **event}])
    self.evals = [row for row in self.evals if row["step"] <= step]
    if self.wandb is not None:
      self._to_wandb({"step": step, **event}, "events")
    self._last_time, self._last_step = time.perf_counter(), step
    self.steps_run = max(self.steps_run - (self._bar.n - step), 0)  # those steps run again
    self._bar.n = step
    self._bar.refresh()

  def close(self) -> None:
    self.flush()
    self._bar.close()
    for file in (self._jsonl, self._tb):  # after a failed write (or rewind: closed), unwritten lost
      with contextlib.suppress(OSError, ValueError) if self.failed else contextlib.nullcontext():
        file.close()
    if self.wandb is not None:
      self.wandb.finish()


def set_aside_torn(path: str) -> int:
  """Moves the lines of `path` (JSONL) that are no whole row (a JSON object and a newline) to
  `<path minus .jsonl>.torn.jsonl`, appending, and says so in one line; returns how many. A
  write cut short (a full disk) tears its row, and the next start's first row would otherwise
  be appended to that line, both lost for every reader."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  keep, torn = [], []
  for line in lines:
    try:
      whole = line.endswith("\n") and isinstance(json.loads(line), dict)
    except ValueError:
      whole = False
    (keep if whole else torn).append(line)
  if not torn:
    return 0
  aside = path.removesuffix(".jsonl") + ".torn.jsonl"
  with open(aside, "a") as f:
    f.writelines(line if line.endswith("\n") else line + "\n" for line in torn)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
  os.replace(tmp, path)
  log.warning(
    "%s: %d torn line%s (a write cut short, e.g. by a full disk) moved to %s",
    path, len(torn), "" if len(torn) == 1 else "s", aside,
  )  # fmt: skip
  return len(torn)


def set_aside_after(path: str, step: int) -> list[dict]:
  """Moves the rows of `path` (JSONL, each with a "step") whose step is after `step` to
  `<path minus .jsonl>.rolled_back.jsonl`, appending; the rows at or before it stay, in order.
  Returns the rows moved."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = f.readlines()
  keep, later, moved = [], [], []
  for line in rows:
    try:
      row = json.loads(line)
      after = row["step"] > step
    except (ValueError, KeyError, TypeError):
      after = False  # not a row of ours: leave it where it is
    if after:
      later.append(line)
      moved.append(row)
    else:
      keep.append(line)
  if not later:
    return []
  with open(path.removesuffix(".jsonl") + ".rolled_back.jsonl", "a") as f:
    f.writelines(later)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
  os.replace(tmp, path)
  return moved
