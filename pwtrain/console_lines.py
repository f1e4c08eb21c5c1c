"""What a run prints on its console besides the metrics rows: the closing summary line, and log
lines kept apart from the progress bar (pwtrain/train.py uses both)."""

import contextlib
import logging

log = logging.getLogger("pwtrain.train")


def summary(logger, start: int, step: int, directory: str, latest, goodput):
  """One closing line: what ran, where it ended, how fast on average, and the goodput."""
  last = next((r for r in reversed(logger.history) if "loss" in r), None)
  loss = f"last loss {last['loss']:.4f}" if last else "no step run"
  if logger.evals:
    loss += f", last eval loss {logger.evals[-1]['eval_loss']:.4f}"
  average = logger.average_tokens_per_s()
  speed = f", {average:,.0f} tokens/s on average" if average else ""
  shares = goodput.row()
  badput = ", ".join(
    f"{k.removeprefix('badput_')} {v:.0%}"
    for k, v in shares.items()
    if k != "goodput" and v >= 0.005
  )
  where = f"latest checkpoint: step {latest} in {directory}" if latest else "no checkpoint"
  log.info(
    "trained steps %d-%d of %d: %s%s; goodput %.0f%% (badput: %s); %s",
    start + 1, step, logger.num_steps, loss, speed, 100 * shares["goodput"], badput or "none",
    where,
  )  # fmt: skip


@contextlib.contextmanager
def above_bar(progress: str):
  """With the bar on a terminal, log lines (eval, checkpoints, rollbacks) are written above it,
  each on a line of its own; plain lines need nothing."""
  if progress != "bar":
    yield
    return
  from tqdm.contrib.logging import logging_redirect_tqdm

  with logging_redirect_tqdm():
    yield
