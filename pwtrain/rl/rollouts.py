"""The GRPO batch source: each step's rollouts sampled from the live parameters by the serving
engine (serve/engine.py) on the training islands, scored, and assembled into the step's batch.

`RolloutBatches` is the RL run's counterpart of data.TrainBatches: `next()` gives the batch of
the next step, `get_state`/`set_state` its position (the prompt source's) for a checkpoint, and
`metrics` the host metrics of the last batch, which the loop writes into that step's row.

A batch (advantages.py) is `rl.prompts_per_step` prompts, each sampled `rl.group_size` times
with rl.temperature/top_k/top_p and up to rl.max_tokens tokens (ending at EOS when
rl.stop_at_eos). The engine's programs read the weights published on the islands (program.Latest)
and the next step is dispatched only once this batch is made, so with rl.max_staleness=0 the
rollouts of step N come from the weights after step N-1, in place: nothing is copied or
synchronised. Every token's event carries the step of the weights that made it; the batch's
`weights_step` is theirs and `weights_step_behind` is the step being trained minus it (0).

rl.max_staleness=1: `next()` returns the batch made while the previous step trained (on the
first step of a start, one made now) and, before the step it returns is dispatched, queues on
each served island a copy of the weights published there (Controller.publish_copy: the weights
after the step dispatched last, copied when the island's queue reaches it, before the next
step donates them); a worker thread waits for that copy (the engine's programs may go ahead
of the island's queued work, so one placed before the copy would read the copy before it), then
makes the next step's batch from it (the engine reads it under `_behind(name)`). Step N's
rollouts thus come from the weights after step N-2 (weights_step_behind 1 from the second step
on), and GRPO's importance ratio corrects for the update between. A checkpoint's state holds
that batch (get_state: its arrays and metrics), as the weights that made it are gone, so a
resumed run trains what the uninterrupted one trains.

Determinism: completion c of the prompt taken at position i draws token t with
fold_in(key(seed), t), the seed a function of (config.seed, i, c) (sequences.choice_seed), so
a resumed run samples what the uninterrupted one samples.

Host metrics of a step: reward_mean, reward_std (over every completion), zero_variance_groups
(the share of groups whose rewards are all equal), response_length (mean completion tokens),
rollout_tokens_per_s (completion tokens / generation_s), generation_s (from the request to the
last token), first_token_s (from the request, made once the previous step has finished, to the
first token: the time from an update to the first rollout token that uses it, nothing copied),
reward_s (the reward function over the batch), train_s (the wait, before the rollouts, for the
islands to finish what was dispatched: the previous step's training; 0 at rl.max_staleness=1,
which does not wait), weights_step and weights_step_behind.
"""

import concurrent.futures
import dataclasses
import threading
import time
import types

import numpy as np

from pwtrain.rl import advantages as advantages_lib
from pwtrain.serve.engine import Engine
from pwtrain.serve.requests import CompletionRequest
from pwtrain.serve.sequences import Completion
from pwtrain.serve.weights import LiveWeights


class RolloutBatches:
  """The batches of an RL run (module doc). `prompts`: tasks.ShiftPrompts or
  prompts.PromptFile; `reward`: rewards.Reward. `start` before the first `next()`."""

  def __init__(self, config, tokenizer, prompts, reward):
    self.config = config
    self.rl = config.rl
    self.tokenizer = tokenizer
    self.prompts = prompts
    self.reward = reward
    self.group_size = int(config.rl.group_size)
    self.num_prompts = config.train.global_batch // self.group_size
    self.seq_len = config.data.seq_len
    self.metrics: dict = {}
    self.engine: Engine | None = None
    self.controller = None
    self.step = 0  # the step the next batch trains (0-based)
    self.behind = int(config.rl.max_staleness)
    self.pending: concurrent.futures.Future | None = None  # rl.max_staleness=1: the next batch
    self.pending_from: dict = {}  # the prompt source's position before it
    self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")

  def start(self, controller, current, state: dict, step: int, *, published: bool = False):
    """Starts the engine on `controller`'s islands over the live weights of `current()` (the
    harness that runs the steps), `state` the state the run starts from at `step`;
    `published`: attached serving has already published it."""
    self.controller, self.step = controller, step
    source = LiveWeights(self.config, controller, current)
    if not published:
      source.start(state)
    settings = types.SimpleNamespace(
      max_batch=self.config.train.global_batch,
      max_len=self.seq_len + 1,  # prompt + completion = the batch's row and its last target
      prefill_chunk=min(self.config.serve.prefill_chunk, self.seq_len + 1),
      queue_size=self.config.train.global_batch,
    )
    self.source = _Behind(source) if self.behind else source
    self.engine = Engine(self.source, controller, self.tokenizer, settings)

  def close(self) -> None:
    self._settle()
    self.worker.shutdown(wait=True)
    if self.engine is not None:
      self.engine.stop()
      self.engine = None

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    began = time.perf_counter()
    if not self.behind:
      self.controller.wait()  # the previous step's training (train_s)
      made = self._make(self.step, began)
    else:  # this step's batch, made while the previous step trained; then the next one's
      made = (self.pending or self._submit(self.step)).result()
      self.pending = self._submit(self.step + 1)
    self.metrics = made["metrics"]
    self.step += 1
    return made["batch"]

  def _submit(self, step: int) -> concurrent.futures.Future:
    """rl.max_staleness=1: the batch of `step` made on the worker thread from a copy of the
    weights published now (those of the step dispatched last), taken on the islands' queues
    before the next step, which donates them, is dispatched."""
    copies = [
      self.controller.publish_copy(cell.island, _behind(cell.name), cell.name)
      for cell in self.source.inner.layout().cells
    ]
    self.pending_from = self.prompts.get_state()  # the worker is idle: nothing pending
    return self.worker.submit(self._make, step, time.perf_counter(), copies)

  def _make(self, step: int, began: float, copies=()) -> dict:
    """{"batch", "metrics"} of `step`: its prompts taken, sampled, scored and assembled;
    `copies` (rl.max_staleness=1): the futures of the weight copies it reads, which it waits
    for first. The engine's programs go ahead of ordinary work queued on an island (policy.py),
    so a program placed before its island has taken the copy would read the one before."""
    for copy in copies:
      copy.result()
    generating = time.perf_counter()
    taken = self.prompts.take(self.num_prompts)
    groups, first_token = self._generate(taken)
    generated = time.perf_counter()
    pairs = zip(taken, groups, strict=True)
    rewards = np.asarray([[self._score(i, row, c) for c in group] for (i, row), group in pairs])
    scored = time.perf_counter()
    adv = advantages_lib.group_advantages(rewards, bool(self.rl.normalize_std))
    rollouts = [c["rollout"] for group in groups for c in group]
    masked = np.repeat(adv.zero_variance, self.group_size)
    batch = advantages_lib.assemble(
      rollouts, adv.values.ravel(), masked, self.seq_len, self.tokenizer.pad_id
    )
    weights_step = min(c["weights_step"] for group in groups for c in group)
    lengths = [len(r.tokens) for r in rollouts]
    metrics = {
      "reward_mean": float(rewards.mean()),
      "reward_std": float(rewards.std()),
      "zero_variance_groups": float(adv.zero_variance.mean()),
      "response_length": float(np.mean(lengths)),
      "rollout_tokens_per_s": sum(lengths) / max(generated - generating, 1e-9),
      "generation_s": generated - generating,
      "first_token_s": first_token - generating,
      "reward_s": scored - generated,
      "train_s": 0.0 if self.behind else generating - began,
      "weights_step": float(weights_step),
      "weights_step_behind": float(step - weights_step),
    }
    return {"batch": batch, "metrics": metrics}

  def get_state(self) -> dict:
    """The prompt source's position; rl.max_staleness=1: after the next step's batch, which is
    saved with it (its arrays and metrics), since the weights that made it are gone."""
    if self.pending is None:
      return {"prompts": self.prompts.get_state()}
    if self.pending.exception() is not None:  # raised by the next `next()`; saved before it
      return {"prompts": self.pending_from}
    made = self.pending.result()
    batch = {k: {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.ravel().tolist()}
             for k, v in made["batch"].items()}  # fmt: skip
    pending = {"batch": batch, "metrics": made["metrics"]}
    return {"prompts": self.prompts.get_state(), "pending": pending}

  def set_state(self, state: dict) -> None:
    self._settle()
    self.prompts.set_state(state["prompts"])
    if "pending" in state and self.behind:
      batch = {k: np.asarray(v["values"], v["dtype"]).reshape(v["shape"])
               for k, v in state["pending"]["batch"].items()}  # fmt: skip
      self.pending = concurrent.futures.Future()
      self.pending.set_result({"batch": batch, "metrics": dict(state["pending"]["metrics"])})

  def _settle(self) -> None:
    """The batch being made, if any, finished and dropped."""
    if self.pending is not None:
      concurrent.futures.wait([self.pending])
      self.pending = None

  # -- one step's rollouts ---------------------------------------------------------------------

  def _generate(self, taken: list) -> tuple[list[list[dict]], float]:
    """Each taken row's `group_size` completions ({"rollout", "text", "weights_step"}), and when
    the first token arrived (time.perf_counter)."""
    encoded = tuple(self.tokenizer.prompt(row[self.rl.prompt_field]) for _, row in taken)
    longest = max(len(e) for e in encoded)
    if longest + self.rl.max_tokens > self.seq_len + 1:
      raise advantages_lib.ConfigError(
        f"a prompt of {longest} tokens and rl.max_tokens={self.rl.max_tokens} do not fit "
        f"data.seq_len={self.seq_len} (prompt + completion - 1 positions); raise data.seq_len"
      )
    first = taken[0][0]
    request = CompletionRequest(
      prompts=tuple(row[self.rl.prompt_field] for _, row in taken),
      encoded=encoded,
      max_tokens=int(self.rl.max_tokens),
      temperature=float(self.rl.temperature),
      top_p=float(self.rl.top_p),
      top_k=int(self.rl.top_k),
      n=self.group_size,
      stop=(),
      seed=int(np.random.SeedSequence([self.config.seed, first]).generate_state(1)[0]),
      stream=False,
      include_usage=False,
      logprobs=None,
      model=None,
      ignore_eos=not self.rl.stop_at_eos,
    )
    collected = _Collected(request.num_sequences)
    self.engine.submit(Completion(request, collected.on_event))
    events = collected.wait()
    groups = []
    for p, prompt in enumerate(encoded):
      group = []
      for c in range(self.group_size):
        got = events[p * self.group_size + c]
        tokens = np.asarray([e.token for e in got], np.int32)
        rollout = advantages_lib.Rollout(
          prompt, tokens, np.asarray([e.sampled_logprob for e in got], np.float32)
        )
        group.append({
          "rollout": rollout,
          "text": self.tokenizer.decode(tokens[tokens != self.tokenizer.eos_id]),
          "weights_step": min(e.step for e in got),
        })  # fmt: skip
      groups.append(group)
    return groups, collected.first

  def _score(self, index: int, row: dict, completion: dict) -> float:
    field = self.rl.prompt_field
    fields = {k: v for k, v in row.items() if k != field}
    line = getattr(self.prompts, "line_of", None)
    where = f"row {index} of {self.prompts.name}"
    if line is not None:
      where = f"line {line(index)} of {self.prompts.name}"
    return self.reward(row[field], completion["text"], fields, where)


def _behind(name: str) -> str:
  """The name the copy of `name`'s weights the rollouts read is published under."""
  return f"{name}/rollouts"


class _Behind:
  """A weights source whose cells are read from the copies `RolloutBatches._submit` publishes."""

  def __init__(self, source):
    self.inner = source

  def layout(self):
    return _renamed(self.inner.layout())

  def spares(self):
    return tuple(_renamed(each) for each in self.inner.spares())


def _renamed(layout):
  cells = tuple(dataclasses.replace(c, name=_behind(c.name)) for c in layout.cells)
  return dataclasses.replace(layout, cells=cells)


class _Collected:
  """The events of one request's sequences, gathered on the engine's thread."""

  def __init__(self, num_sequences: int):
    self.events: list[list] = [[] for _ in range(num_sequences)]
    self.left = num_sequences
    self.error: str | None = None
    self.first: float | None = None  # when the first token arrived (time.perf_counter)
    self.done = threading.Condition()

  def on_event(self, event) -> None:
    with self.done:
      if self.first is None:
        self.first = time.perf_counter()
      if event.error is not None:
        self.error = event.error
        self.left = 0
      else:
        self.events[event.index].append(event)
        if event.finish_reason is not None:
          self.left -= 1
      if self.left <= 0:
        self.done.notify_all()

  def wait(self) -> list[list]:
    with self.done:
      self.done.wait_for(lambda: self.left <= 0)
    if self.error is not None:
      raise RuntimeError(f"rollouts failed: {self.error}")
    return self.events
