"""`Harness`: from a config to a ready train step, the one way train.py, the tests and the
benchmarks build and drive one.

  cluster     parallel/plan.make_cluster: the local devices carved into islands, or the workers
  plan        parallel/plan.build: the layout (meshes, cells, stages, exchange)
  controller  backend.Controller: backend.max_inflight_steps run ahead, backend.launch_window
  program     parallel.build_step_program: the compiled StepProgram (parallel/program.py)

then `init()` for a fresh train state, `step(state, batch, i)` to dispatch step i and
`evaluate(state, batches)` for the summed eval losses of a state. A caller may bring its own
cluster (remote workers it attached itself), resource manager (islands shared with other
clients) or controller (shared with other clients); the harness closes only what it created.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import time
from collections.abc import Iterable
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
import optax

from pwtrain import liveness, objectives, optim, processes
from pwtrain import step as step_lib
from pwtrain.backend import Cluster, Controller, Node, Program, ResourceManager, Trace, Transfer
from pwtrain.backend.pulls import PullDeadlines
from pwtrain.backend.run_mode import results
from pwtrain.backend.saved import NotSaved, SavedExecutables, digest
from pwtrain.parallel import build_step_program
from pwtrain.parallel import plan as plan_lib
from pwtrain.parallel.plan import Plan
from pwtrain.parallel.program import StepProgram

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepOutputs:
  """What `Harness.step` dispatched: futures, none of them waited on."""

  state: dict[str, concurrent.futures.Future]  # the next train state, under `state_keys`
  metrics: concurrent.futures.Future  # the step's metrics dict (loss, grad_norm, lr, ...)


@dataclasses.dataclass(frozen=True)
class Harness:
  """A compiled step for `config` on its cluster and controller. Build with `Harness.build`."""

  config: Any
  cluster: Cluster
  plan: Plan
  controller: Controller
  step_program: StepProgram
  tx: Any  # the optax optimizer the step applies (optim.build)
  schedule: Any  # its learning-rate schedule: step -> lr
  compile_s: float  # seconds build_step_program took (compiling every piece)
  objective: Any = None  # what the step minimises (objectives.make)
  owns_cluster: bool = dataclasses.field(default=True, repr=False)
  owns_controller: bool = dataclasses.field(default=True, repr=False)

  @classmethod
  def build(
    cls,
    config,
    devices=None,
    *,
    cluster: Cluster | None = None,
    plan: plan_lib.Plan | None = None,
    resources: ResourceManager | None = None,
    controller: Controller | None = None,
    trace: Trace | None = None,
    serialize_execution: bool | None = None,
    saved_dir: str | None = None,
    objective=None,
  ) -> "Harness":
    """Lays `config` out and compiles its step. Checking the config is the caller's
    (config.validate; train.run checks it before remote workers are launched and listed in it).

    The cluster is `plan_lib.make_cluster(config, devices)` (devices: default all local ones)
    unless `cluster` is given; the plan is `plan_lib.build(config, cluster, resources)` unless
    `plan` (laid out on the given `cluster`) is: its islands are allocated from `resources`
    (default: a fresh manager for the cluster). The controller is a new `Controller` with the
    backend.* bounds (module docstring), `trace` and `serialize_execution` unless `controller`
    is given (then `trace` and `serialize_execution` must be left unset).
    With `saved_dir` (and a controller that `saves_pieces`), the compiled pieces are kept there
    under what built them (`build_key`), and a later build of the same key loads them without
    tracing (backend/saved.py). `objective`: objectives.make's (default: of `config` alone).
    """
    if cluster is not None and devices is not None:
      raise ValueError("Harness.build: give `devices` or a `cluster`, not both")
    if controller is not None and (trace is not None or serialize_execution is not None):
      raise ValueError("Harness.build: `trace`/`serialize_execution` are for a new controller")
    if plan is not None and (cluster is None or resources is not None):
      raise ValueError("Harness.build: a `plan` comes with the `cluster` it was laid out on")
    owns_cluster = cluster is None
    if owns_cluster:
      cluster = plan_lib.make_cluster(config, devices)
    owns_controller = controller is None
    try:
      if plan is None:
        plan = plan_lib.build(config, cluster, resources)
      if owns_controller:
        controller = Controller(
          cluster,
          max_inflight=config.backend.max_inflight_steps,
          launch_window=config.backend.launch_window,
          trace=trace,
          serialize_execution=serialize_execution,
          # Distributed mode: a pull ends once its peer is late or lost (pwtrain/liveness.py).
          pulls=PullDeadlines(
            config.backend.pull_timeout_s, liveness.peer_lost, config.fault.elastic
          ),
          # Elastic pods in distributed mode run a step again from the state it started from,
          # wherever it finished (elastic/agreement.py).
          donate=not (config.fault.elastic and config.backend.mode == "distributed"),
        )
      tx, schedule = optim.build(config.optim, config.train.num_steps)
      objective = objectives.make(config) if objective is None else objective
      start = time.perf_counter()
      saved = None
      if saved_dir and controller.saves_pieces:
        saved = SavedExecutables(saved_dir, build_key(config, plan, objective))
      try:
        step_program = _build_step(config, plan, controller, tx, schedule, objective, saved)
      except NotSaved as e:  # a loading build missing a piece: traced whole instead
        log.warning("the compiled pieces in %s did not load (%s); tracing them", saved_dir, e)
        saved = saved.discard()
        step_program = _build_step(config, plan, controller, tx, schedule, objective, saved)
      if saved:
        saved.finish()
        log.info(
          "compiled pieces: %d loaded from %s without tracing, %d traced and saved, %d traced "
          "and found in JAX's compilation cache (not saved)",
          len(saved.loaded), saved_dir, len(saved.saved), len(saved.from_cache),
        )  # fmt: skip
      compile_s = time.perf_counter() - start
    except BaseException:
      _close(controller if owns_controller else None, cluster if owns_cluster else None)
      raise
    return cls(
      config, cluster, plan, controller, step_program, tx, schedule, compile_s, objective,
      owns_cluster=owns_cluster, owns_controller=owns_controller,
    )  # fmt: skip

  def init(self) -> dict:
    """A fresh train state (seeded by config.seed), computed on the islands: {state key: value}."""
    return self.step_program.init()

  def step(
    self,
    state: dict,
    batch: dict,
    step: int,
    *,
    program: Program | None = None,
    host_metrics: bool = True,
  ):
    """Dispatches step `step` (0-based) on `state` (as `init` or a previous step returned it)
    and a host batch (the objective's columns, objectives.py); returns its `StepOutputs`.

    The program is `step_program.program_for(step)` unless `program` is given (a benchmark
    timing one of a layout's programs alone). Blocks only for the controller's run-ahead bound.
    Distributed mode: the metrics are read on every process (`processes.to_host`), unless
    `host_metrics=False` (then they are the program's output, on one island's processes; the
    caller reads them: elastic/agreement.py, once the processes agree the step ran).
    """
    sp = self.step_program
    program = program or sp.program_for(step)
    out = self.controller.run(program, {**state, **sp.feed(batch)})
    metrics = out["metrics"]
    if processes.active() and host_metrics:  # on one island's processes: read them on all
      metrics = self._host.submit(self._to_host, metrics, "metrics")
    return StepOutputs({k: out[k] for k in sp.state_keys}, metrics)

  def settle(self, state: dict) -> dict:
    """The state after every dispatched step, as it is (elastic.ElasticSteps, which has the
    same interface, may replace it with the state of failed steps run again)."""
    return state

  def whole(self, state: dict) -> dict:
    """The whole-model state after every dispatched step, read (the run's result; ElasticSteps
    drops a pod lost while it is read and reads the survivors' instead)."""
    return self.step_program.to_checkpoint(results(self.settle(state)))

  def rows_read_here(self) -> tuple[int, ...]:
    """The rows of a global batch (train.global_batch rows) that this process feeds: every
    row, except in distributed mode, where an island of another process takes its rows from its
    own process's reader, and an island spanning processes takes from each process the rows its
    devices there hold (controller: a host value onto such an island reads only those). The
    batch inputs go to the same islands in every program of a layout."""
    sp, shape = self.step_program, (self.config.train.global_batch, self.config.data.seq_len)
    feed_rows = sp.feed_rows(shape[0])
    rows: set[int] = set()
    for node in sp.program_for(0).nodes:
      if not self.controller.runs_here(node.island):
        continue
      if isinstance(node, Transfer) and node.src in feed_rows:
        fed = feed_rows[node.src]
        local = node.sharding.addressable_devices_indices_map((len(fed), shape[1])).values()
        rows.update(r for index in local for r in fed[index[0]])
      elif isinstance(node, Node):  # takes a batch input as it is
        rows.update(r for ref in node.args if ref in feed_rows for r in feed_rows[ref])
    return tuple(sorted(rows))

  @functools.cached_property
  def _host(self) -> concurrent.futures.ThreadPoolExecutor:
    """Distributed mode: one thread reads device values on the host, in dispatch order."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pwtrain-host")

  @staticmethod
  def _to_host(future: concurrent.futures.Future, what: str):
    return processes.to_host(future.result(), processes.next_key(what))

  def evaluate(self, state: dict, batches: Iterable[dict]) -> dict[str, float]:
    """The summed {"ce_sum", "z_sum", "tokens"} (step.EVAL_KEYS) of the model in `state` over
    host `batches`, from the forward-only program (compiled on first use); waits for them.

    The state is read, not donated: a step dispatched afterwards may take it. Partial sums are
    added on the host in float64, in program-output order (`eval_sums`).
    """
    futures = self.dispatch_eval(state, batches)
    if processes.active():  # in order with the steps' metrics (the same thread and count)
      parts = [self._host.submit(self._to_host, f, "eval").result() for f in futures]
    else:
      parts = jax.device_get([f.result() for f in futures])
    return eval_sums(parts)

  def dispatch_eval(self, state: dict, batches: Iterable[dict]) -> list:
    """`evaluate`'s programs dispatched, one per batch: the futures of their partial sums, in
    program-output order, none waited on."""
    sp = self.step_program
    outs = [self.controller.run(sp.eval_program, {**state, **sp.feed(b)}) for b in batches]
    return [f for out in outs for f in out.values()]

  def logprobs(self, state: dict, batch: dict, *, reference: bool = False) -> np.ndarray:
    """[b, L] host log-probs of `batch`'s targets under the objective's distribution
    (step.token_logprobs) with `state`'s params (or its `reference`'s), on the island."""
    state = {k: v.result() if hasattr(v, "result") else v for k, v in state.items()}
    params = self.step_program.to_checkpoint(state)["reference" if reference else "params"]
    params = params if self.plan.single_island else jax.device_get(params)  # on one device
    return np.asarray(self._logprobs(params, {k: batch[k] for k in ("inputs", "targets")}))

  @functools.cached_property
  def _logprobs(self):
    fns = step_lib.model_fns(self.config.model, self.config.moe)
    return jax.jit(step_lib.token_logprobs(fns, self.objective))

  def with_controller(self, controller: Controller) -> "Harness":
    """This compiled step dispatched by `controller` (e.g. one with a Trace), on the same
    cluster; closing the result closes nothing."""
    return dataclasses.replace(
      self, controller=controller, owns_cluster=False, owns_controller=False
    )

  def close(self) -> None:
    """Waits for every dispatched step, then closes the controller and the cluster (remote:
    disconnects from the workers), each only if this harness created it."""
    _close(
      self.controller if self.owns_controller else None,
      self.cluster if self.owns_cluster else None,
    )

  def __enter__(self) -> "Harness":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def eval_sums(parts: list[dict]) -> dict[str, float]:
  """The evaluation's partial sums (host values, in program-output order) added in float64."""
  return {k: float(sum(np.float64(part[k]) for part in parts)) for k in step_lib.EVAL_KEYS}


def _close(controller: Controller | None, cluster: Cluster | None) -> None:
  try:
    if controller is not None:
      controller.wait()
      controller.close()
  finally:
    if cluster is not None:
      cluster.close()


def _build_step(config, plan, controller, tx, schedule, objective, saved) -> StepProgram:
  """build_step_program, its pieces loaded from or saved in `saved` (if any), every compile
  ended (errors raised here, not at a step)."""
  with controller.saving(saved) if saved else contextlib.nullcontext():
    try:
      step_program = build_step_program(config, plan, controller, tx, schedule, objective)
    except BaseException:
      # A piece that failed while building (a saved piece that did not load, met where the
      # build reads a piece's outputs): the build's other compiles end here, so that a retry's
      # wait_compiles meets only its own.
      with contextlib.suppress(Exception):
        controller.wait_compiles()
      raise
  controller.wait_compiles()
  return step_program


def build_key(config, plan: Plan, objective) -> str:
  """What decides the programs `Harness.build` traces and compiles for `config` on `plan`, as a
  digest: the config, the objective's `num_tokens` (not in the config), the islands' devices,
  pwtrain's source, the versions of the libraries and PJRT plugins that trace and compile
  (`_versions`), the backends' platform versions, JAX's settings (but where it logs, dumps and
  caches), the environment XLA and the plugins read (`_environment`) and this host's CPU
  (`_host_cpu`: XLA:CPU compiles for its features)."""
  devices = [(i.name, [(d.id, d.platform, d.device_kind) for d in i.devices]) for i in plan.islands]
  platforms = sorted(
    {(d.platform, d.client.platform_version) for i in plan.islands for d in i.devices}
  )
  settings = sorted(
    (k, repr(v))
    for k, v in jax.config.values.items()
    if not any(w in k for w in ("cache", "log", "dump", "address", "timeout", "traceback"))
  )
  return digest(
    config.to_json_best_effort(sort_keys=True),
    objective.num_tokens,
    devices,
    platforms,
    _source_digest(),
    _versions(),
    settings,
    _environment(),
    _host_cpu(),
  )


@functools.cache
def _source_digest() -> str:
  root = pathlib.Path(__file__).parent
  return digest(*((str(p.relative_to(root)), p.read_bytes()) for p in sorted(root.rglob("*.py"))))


@functools.cache
def _versions() -> tuple:
  """jax, jaxlib, flax, optax and numpy, and every installed PJRT plugin or TPU runtime (the
  jax-cuda*/jax-rocm* plugins, libtpu)."""
  from importlib import metadata

  plugins = sorted(
    (d.metadata["Name"], d.version)
    for d in metadata.distributions()
    if (d.metadata["Name"] or "")
    .lower()
    .replace("_", "-")
    .startswith(("jax-cuda", "jax-rocm", "libtpu"))
  )
  return (
    jax.__version__,
    jaxlib.__version__,
    flax.__version__,
    optax.__version__,
    np.__version__,
    plugins,
  )


# The environment that changes what XLA or a PJRT plugin compiles: XLA_FLAGS and the flags of
# the TPU runtime and NCCL.
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_ENVIRONMENT_PREFIXES = ("NCCL_", "TPU_", "XLA_")


def _environment() -> tuple:
  return tuple(
    sorted(
      (k, v)
      for k, v in os.environ.items()
      if k in _ENVIRONMENT or k.startswith(_ENVIRONMENT_PREFIXES)
    )
  )


@functools.cache
def _host_cpu() -> tuple:
  """This host's architecture and CPU features (/proc/cpuinfo's flags, or on Arm its Features):
  an XLA:CPU executable uses the instructions of the CPU it was compiled on."""
  import platform

  features = ""
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          features = line.split(":", 1)[1].strip()
          break
  return platform.machine(), features
