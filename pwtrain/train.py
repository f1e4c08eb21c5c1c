"""`run(config, workdir)`: the whole training job, top to bottom."""

import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Any

import jax

from pwtrain import (
  compile_cache,
  console_lines,
  drills,
  guard,
  objectives,
  processes,
  restore,
  rl,
  serve,
  wandb_run,
)
from pwtrain import config as config_lib
from pwtrain import metrics as metrics_lib
from pwtrain import workdir as workdir_lib
from pwtrain.backend import Trace, modes
from pwtrain.backend.faults import IslandLost
from pwtrain.checkpoint import Checkpointer, IncompatibleCheckpoint, saving
from pwtrain.data import (
  TrainBatches,
  build_eval_set,
  merge_states,
  open_train_source,
  streams_of_rows,
)
from pwtrain.elastic import ElasticSteps
from pwtrain.errors import ConfigError, UserError, WriteFailed
from pwtrain.goodput import Goodput
from pwtrain.harness import Harness
from pwtrain.metrics import PROGRESS, MetricsLogger, peak_flops
from pwtrain.models import arithmetic
from pwtrain.parallel import plan as plan_lib
from pwtrain.preemption import StopRequest
from pwtrain.profiling import StepProfiler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
  history: list[dict]  # one row per step run in this call: loss, ce_loss, grad_norm, lr, ...
  # The final whole-model train state (device arrays), as checkpointed; for a run that had
  # nothing left to train, its latest checkpoint read back (None in a run of several processes).
  state: dict | None
  start_step: int
  final_step: int
  evals: list[dict] = dataclasses.field(default_factory=list)  # {"step", "eval_loss", ...}


def run(config, workdir: str, *, show_progress: bool = True, progress: str = "auto") -> RunResult:
  """Trains `config` in `workdir`. `progress`: "bar" (tqdm), "lines" (one plain line per
  train.log_every on stdout), "none", or "auto" (the bar on a terminal, else lines); only
  process 0 shows it. `show_progress=False` is "none"."""
  goodput = Goodput()  # the run's wall time starts now
  config_lib.validate(config)
  rl.validate(config)  # an RL run's loop (train.objective="grpo")
  mode = modes.for_backend(config.backend)
  if progress not in PROGRESS:
    raise ConfigError(f"--progress={progress!r} is not one of {', '.join(PROGRESS)}")
  if not show_progress or jax.process_index() != 0:
    progress = "none"
  elif progress == "auto":
    progress = "bar" if sys.stdout.isatty() else "lines"
  context = RunContext(mode, progress, goodput)

  def run_once(config) -> RunResult:
    # Laid out once, before anything is written: a bad layout writes nothing. serve.enabled: the
    # port is bound first, so that one in use is one line too.
    listening = serve.listening(config) if config.serve.enabled else contextlib.nullcontext()
    with listening as sock, contextlib.closing(plan_lib.make_cluster(config)) as cluster:
      plan = plan_lib.build(config, cluster)
      drills.check(config, plan)
      before = workdir_lib.snapshot(workdir)
      try:
        return _run(config, workdir, dataclasses.replace(context, serve_socket=sock), cluster, plan)
      except Exception as e:
        # Refused before the first step (data, tokenizer, resume checks; a full disk, in one
        # line): the workdir is left as it was. Once training has begun nothing is removed.
        refused = saving.start_refused(e, workdir)
        if goodput.loop_start is None and (refused or isinstance(e, UserError)):
          if jax.process_count() == 1:
            workdir_lib.undo(workdir, before)
          if refused:
            raise refused from e
        raise

  # Remote mode launches (and after a lost worker restarts) the island workers around it; the
  # workers it launches share the compilation cache.
  sizes = plan_lib.island_sizes(config, jax.device_count())
  with compile_cache.of_run(config.train, os.path.abspath(workdir)):
    return mode.supervise(config, run_once, sizes, os.path.abspath(workdir))


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What every start of the run shares: its mode, its progress display and its goodput."""

  mode: Any  # backend.run_mode.RunMode
  progress: str  # "bar", "lines" or "none"
  goodput: Goodput
  serve_socket: Any = None  # serve.enabled: where the attached server listens (serve.listening)


def _run(config, workdir: str, context: RunContext, cluster, plan) -> RunResult:
  """One start of the run in `workdir` on `plan` over `cluster`."""
  workdir = workdir_lib.prepare(workdir)
  # Distributed mode: process 0 holds the workdir and builds the data first; every process
  # writes its checkpoint shards to <workdir>/checkpoints and its own logs (metrics, traces) to
  # its host directory, <workdir> for process 0 and <workdir>/processes/<i> for the others.
  primary = jax.process_index() == 0
  host_dir = workdir if primary else os.path.join(workdir, "processes", str(jax.process_index()))
  os.makedirs(host_dir, exist_ok=True)
  with workdir_lib.WorkdirLock(workdir) if primary else contextlib.nullcontext():
    # What the checkpoints say decides before anything is built: a finished run compiles nothing.
    finished = restore.finished(config, workdir)
    if finished is not None:
      step, state = finished
      return RunResult([], state, step, step)
    if not primary and not processes.rejoining():  # a process started again finds it built
      processes.barrier("data")
    rollouts = rl.rollout_batches(config, workdir) if config.train.objective == "grpo" else None
    tokenizer, source = (rollouts.tokenizer, ()) if rollouts else open_train_source(config, workdir)
    # GRPO's log-probs cut the ids the sampler never draws: those past the tokenizer's.
    objective = objectives.make(config, num_tokens=tokenizer.vocab_size if rollouts else None)
    eval_set = build_eval_set(config, workdir, tokenizer) if config.train.eval_every else None
    if primary:
      processes.barrier("data")
    trace = Trace() if config.backend.trace else None
    try:
      # Closed last: waits for every step.
      with context.goodput.bad("compile"):
        harness = Harness.build(
          config, cluster=cluster, plan=plan, trace=trace, saved_dir=compile_cache.pieces(),
          objective=objective,
        )  # fmt: skip
        compile_cache.within_cap(config.train)
      with harness:
        batches = rollouts or _train_batches(config, tokenizer, source, harness)
        return _train(config, harness, context, batches, eval_set, workdir, host_dir)
    finally:
      if trace is not None:
        trace.write(os.path.join(host_dir, "trace.json"))


def _train(config, harness, context: RunContext, batches, eval_set, workdir: str, host_dir: str):
  step_program, plan = harness.step_program, harness.plan
  mode, goodput = context.mode, context.goodput
  # fault.elastic: steps over the live pods, which drop a lost pod and carry on (elastic/).
  steps = ElasticSteps(config, harness, goodput) if config.fault.elastic else harness
  # A process started in a dead one's place (elastic pods) joins the others at a step boundary.
  joined = steps.join() if processes.rejoining() else None
  writer = mode.sole_writer(config.fault.elastic)  # elastic, distributed: process 0 saves alone
  ckpt = Checkpointer(
    os.path.join(workdir, "checkpoints"),
    keep=config.train.keep_checkpoints,
    every=config.train.checkpoint_every,
    async_save=config.train.async_checkpoint,
    part_writer=mode.part_writer(plan.islands) if writer is None else None,
    # Elastic pods: a save whose worker was lost is discarded; the run goes on without the pod.
    discard_if=(lambda e: isinstance(e, IslandLost)) if config.fault.elastic else None,
    writer=writer,
  )
  if joined is None:
    state, start = _restore_or_init(config, ckpt, step_program, batches)
  else:
    state, start, data_position = joined
    batches.set_state(data_position)
  for change in workdir_lib.config_changes(host_dir, config, start):
    log.warning("resuming at step %d with a changed setting: %s", start, change)
  num_steps = config.train.num_steps
  logger = MetricsLogger(
    host_dir,
    start_step=start,
    num_steps=num_steps,
    log_every=config.train.log_every,
    tokens_per_step=config.train.global_batch * config.data.seq_len,
    flops_per_token=arithmetic.flops_per_token(config.model, config.moe, config.data.seq_len),
    num_devices=sum(i.num_devices for i in plan.islands),
    peak_flops_per_device=peak_flops(plan.islands[0].devices[0]),
    exchange_bytes_per_step=step_program.exchange_bytes,
    progress=context.progress,
    goodput=goodput,
    devices=tuple(
      d for i in plan.islands for d in i.devices if d.process_index == jax.process_index()
    ),
    wandb_run=wandb_run.start(
      config.metrics.wandb_project if host_dir == workdir else "",  # process 0's alone
      config.metrics.wandb_entity,
      workdir,
      config.to_dict(),
      start,
    ),
  )
  monitor = guard.SpikeMonitor(config.train.rollback_after, config.train.max_rollbacks)
  profiler = StepProfiler(host_dir, config.train.profile_steps)
  step = start
  # Distributed mode: processes stop at one agreed step (pwtrain/processes.py).
  agreement = None
  if processes.active():
    agreement = processes.StopAgreement(margin=config.backend.max_inflight_steps + 2)
  logger.record_once(start, compile_s=harness.compile_s)
  goodput.begin_loop()
  try:
    serving = _serving(config, harness, steps, state, workdir, context, batches)
    sampling = rl.running(batches, harness, state, start)  # an RL run's rollouts
    with StopRequest() as stop, console_lines.above_bar(context.progress), serving, sampling:
      while step < num_steps:
        profiler.before_step(step)
        if config.fault.elastic:  # drills, and lost pods rejoining, before the batch is read
          state = steps.boundary(state, step, batches.get_state)
        waited = time.perf_counter()
        batch = next(batches)
        waited = time.perf_counter() - waited
        goodput.add("data_wait", waited)
        logger.add_data_wait(waited)
        out = steps.step(state, batch, step)
        state, step = out.state, step + 1
        logger.record(step, out.metrics, getattr(batches, "metrics", None))
        ckpt.check_saves()  # a save that failed since stops the run here, in one line
        if step == start + 1:  # the record of what this start trains with, once it trains
          workdir_lib.save_config(host_dir, config, start)
        profiler.after_step(step, out.metrics.result)
        first_bad = monitor.observe(logger.history)
        if first_bad is not None:
          with goodput.bad("rerun"):  # the steps since the checkpoint run again
            steps.settle(state)  # the abandoned steps still in flight
            harness.controller.wait()
            before = step
            state, step = _roll_back(
              config, first_bad, step, ckpt, steps.step_program, batches, logger
            )
          goodput.add("rerun", (before - step) * logger.step_time_s)
          continue
        stopping = agreement.at(step, stop.requested) if agreement else stop.requested
        if ckpt.should_save(step, num_steps) or stopping:
          with goodput.bad("checkpoint"):
            state = steps.settle(state)
            whole = steps.step_program.to_checkpoint(mode.saveable(state))
            ckpt.save(step, whole, _data_state(batches, config.fault.elastic))
        if stopping:
          log.warning("stop requested: checkpointed step %d and stopping", step)
          break
        if eval_set is not None and _eval_due(step, config.train.eval_every, num_steps):
          with goodput.bad("eval"):
            state = steps.settle(state)
            _evaluate(steps, state, eval_set, step, logger)
    logger.flush()  # the last rows, here: a write refused is one line below, not in `finally`
    state = steps.whole(state)  # elastic: a pod lost meanwhile is dropped
  except WriteFailed as e:  # the storage refused the logs: the run stops here, in one line
    ckpt.wait()  # the saves in flight committed (or their own failure raised)
    raise e.stopped(step, ckpt.latest_step()) from None
  finally:
    profiler.close()
    logger.close()
    goodput.end_loop()
    try:
      ckpt.wait()  # a failed save is raised here, once this and then the harness are closed
      latest = ckpt.latest_step()
    finally:
      ckpt.close()
  console_lines.summary(logger, start, step, ckpt.directory, latest, goodput)
  return RunResult(logger.history, state, start, step, logger.evals)


def _serving(config, harness, steps, state: dict, workdir: str, context: RunContext, batches):
  """serve.enabled: the run's live parameters served over HTTP while the loop runs, its
  programs a priority client of the run's controller (pwtrain/serve/, docs/serving.md)."""
  if not config.serve.enabled:
    return contextlib.nullcontext()
  current = (lambda: steps.harness) if config.fault.elastic else (lambda: harness)
  tokenizer, sock = getattr(batches, "tokenizer", None), context.serve_socket  # an RL task's
  return serve.attached(config, harness.controller, current, state, workdir, sock, tokenizer)


def _evaluate(steps, state: dict, eval_set, step: int, logger: MetricsLogger) -> None:
  values = metrics_lib.eval_metrics(steps.evaluate(state, eval_set.batches), eval_set.num_bytes)
  logger.record_eval(step, values)
  log.info(
    "step %d: eval loss %.4f, perplexity %.2f, %.4f bits/byte",
    step,
    values["eval_loss"],
    values["eval_perplexity"],
    values.get("eval_bits_per_byte", float("nan")),
  )


def _eval_due(step: int, every: int, num_steps: int) -> bool:
  """Evaluate after every `every`-th step and after the last one."""
  return step % every == 0 or step == num_steps


def _train_batches(config, tokenizer, source, harness: Harness) -> TrainBatches:
  """This process's reader of the training batches: the data streams whose rows its islands
  read (every stream, except in distributed mode: loader.py on data.streams; with elastic pods
  every stream, since a survivor may take any pod's rows)."""
  rows = harness.rows_read_here()
  if config.fault.elastic:
    rows = tuple(range(config.train.global_batch))
  batches = TrainBatches(config, tokenizer, source, streams_of_rows(config, rows))
  if processes.active():
    me, num, read = jax.process_index(), batches.num_streams, batches.streams
    log.info("process %d reads data streams %s of data.streams=%d", me, list(read), num)
    if len(read) * batches.rows_per_stream > len(rows):
      log.warning(
        "process %d reads %d rows of each batch to use %d of them: data.streams=%d packs them "
        "together; to read only this process's rows, make its rows whole streams (data.streams "
        "= the pods, or the processes of an island that spans them, or a multiple)",
        me, len(read) * batches.rows_per_stream, len(rows), num,
      )  # fmt: skip
  return batches


def _data_state(batches: TrainBatches, elastic: bool) -> dict:
  """The data position to checkpoint, every stream's: in distributed mode each process reads
  only some streams, so their positions are gathered from the processes. With elastic pods
  every process reads every stream (`_train_batches`), so its own position is every stream's
  (nothing is gathered: no process waits for one that may be dead), and a dropped pod's stream
  goes on with the others: the survivors read its rows each step (and train on them, or with
  fault.keep_global_batch=False skip them), so the position saved while degraded is the
  uninterrupted run's, and a resume reads the batches that run reads."""
  if elastic or not isinstance(batches, TrainBatches):  # an RL run's prompts: one process
    return batches.get_state()
  return merge_states(processes.gather(processes.next_key("data"), batches.get_state()))


def _restore_or_init(config, ckpt: Checkpointer, step_program, batches):
  if ckpt.latest_step() is None:
    return rl.initial_state(config, step_program), 0  # rl.init_from's params, else init
  try:
    step, state, data_state = _latest_or_init(ckpt, step_program)
  except IncompatibleCheckpoint as e:
    raise ConfigError(
      f"a checkpoint in {ckpt.directory} does not match this config's model/optimizer (was it "
      f"written by another model?): {e}. Nothing was changed; use another --workdir."
    ) from e
  if data_state is None:
    log.error("no readable checkpoint left in %s: starting from step 0", ckpt.directory)
    return state, 0
  batches.set_state(data_state)
  log.info("resumed from step %d", step)
  return state, step


def _latest_or_init(ckpt: Checkpointer, step_program):
  """(step, train state, data state) of the newest readable checkpoint, or (0, a fresh state,
  None) when there is none."""
  found = ckpt.restore_latest(step_program.abstract_state)
  if found is None:
    return 0, step_program.init(), None
  step, whole, data_state = found
  return step, step_program.from_checkpoint(whole), data_state


def _roll_back(config, first_bad, step, ckpt, step_program, batches, logger):
  """PaLM's loss-spike recipe: back to the last checkpoint before the run of skipped steps that
  began at `first_bad`, keeping the data iterator where it is (the batches since that checkpoint
  are not seen again) and skipping train.rollback_skip_batches more."""
  ckpt.wait()
  # Later checkpoints belong to the abandoned trajectory: set aside (kept), so that neither a
  # resume nor the re-saved steps meet them.
  for later in [s for s in ckpt.all_steps() if s >= first_bad]:
    ckpt.quarantine(later, reason="rolled_back")
  target, state, _ = _latest_or_init(ckpt, step_program)
  for _ in range(config.train.rollback_skip_batches):
    next(batches)
  skipped = step - target + config.train.rollback_skip_batches
  log.warning(
    "%d consecutive non-finite steps from step %d: rolled back to step %d, skipping %d batches",
    config.train.rollback_after,
    first_bad,
    target,
    skipped,
  )
  logger.rewind(target, rollback_from=step, first_bad_step=first_bad, batches_skipped=skipped)
  return state, target
