"""Elastic pods (`fault.elastic=True`): a lost pod costs seconds, not a restart.

`ElasticSteps` wraps the run's Harness and drives steps with the same interface (`step`,
`settle`, `evaluate`, `whole`, `step_program`), over one controller and one cluster; the trainer
also calls `boundary` before each step's batch is read (drills, rejoins), and a process started in a
dead one's place `join`s (distributed mode):

  detect   a step fails with `backend.faults.IslandLost`: a pod's devices failed (embedded),
           its worker died or went silent (remote: `WorkerLost`), or a drill made it so
           (`fault.inject`: embedded marks the islands lost, remote SIGKILLs their workers).
           Each step is confirmed (its metrics read, its state computed on every live pod)
           while the next one runs, so a loss is seen one step after it happens, or at once
           where the next step cannot be sent.
  drop     the lost pods leave the live pod set, whose harness is the full set's program with
           each lost pod hosted by a survivor (nothing compiles), or one built for the
           survivors (compiled once per pod set, then cached): podsets.py. The state the first
           failed step started from stays on the survivors' islands (or is laid out on them
           device to device; no file is read), and the failed steps run again with the same
           batches. No survivor restarts.
  batch    by default the survivors take the lost pods' rows (`fault.keep_global_batch`), so
           with the sync or overlapped exchange the trajectory is the uninterrupted run's; else
           the batch shrinks to the live pods' rows.
  rejoin   when a lost pod's islands can run again (remote: its workers answer again, relaunched
           by the supervisor or by someone else), they are given every executable again and the
           live pods' state is copied onto them, island to island, at the next step boundary;
           then every pod runs again (distributed mode: a dead process started again,
           agreement.py). A pod that a later drill `rejoin:podP@stepN` names comes back at step
           N, not earlier; in remote mode the drill waits there for its workers to answer.
  too few  below `fault.min_pods` live pods (or none) the loss is raised, with one line.

What each exchange mode does with a lost pod: docs/reliability.md. Every metrics row carries
`pods_live`; each drop and rejoin is one log line (lines.py). Drills: pwtrain/drills.py.
"""

import collections
import functools
import logging
import time

import numpy as np

from pwtrain import processes
from pwtrain.backend.faults import IslandLost
from pwtrain.backend.run_mode import results
from pwtrain.drills import parse_inject
from pwtrain.elastic import cells, lines
from pwtrain.elastic.agreement import Agreement
from pwtrain.elastic.pending import Metrics, Pending
from pwtrain.elastic.podsets import PodSets
from pwtrain.elastic.wedge import wedge
from pwtrain.harness import Harness, StepOutputs, eval_sums

log = logging.getLogger(__name__)


class ElasticSteps:
  """The run's steps over the live pods (see the module doc). Closing the first harness (the
  caller's) closes the controller and the cluster; the others own nothing."""

  def __init__(self, config, harness: Harness, goodput=None):
    """`goodput`: the run's goodput.Goodput, told what each drop lost (rerun) and each rejoin
    took (degraded)."""
    self.config = config
    self.goodput = goodput
    self.controller = harness.controller
    plan = harness.plan
    stages = config.parallel.stages
    # Configured pod p's islands, in the plan's order: the survivors' plans are laid on them.
    self._islands = {p: plan.islands[p * stages : (p + 1) * stages] for p in range(plan.num_pods)}
    self._pod_of = {i.name: p for p, islands in self._islands.items() for i in islands}
    self.num_pods = plan.num_pods
    self._pending: collections.deque[Pending] = collections.deque()
    self._drills = parse_inject(config.fault.inject, plan.num_pods)
    self._rejoining: set[int] = set()
    # The state the last dispatched step produces: what the trainer holds, unless a drop ran
    # the pending steps again (then theirs). `_given` is what the trainer was handed.
    self._head: dict | None = None
    self._fatal: IslandLost | None = None
    self._given: dict | None = None
    self._killed_at: float | None = None  # when the last drill killed a pod (its detection)
    self._steps = 0  # steps dispatched so far: an evaluation's place (after step N)
    self._confirmed_at = time.perf_counter()  # when the last step was confirmed
    # Distributed mode: the processes agree on each step and on the live pods (agreement.py).
    self._agreement = Agreement(plan, self.controller, stages) if processes.active() else None
    self.pods = PodSets(config, harness, self._islands, self._agreement)

  @property
  def live(self) -> tuple:
    """The live pods (configured numbers)."""
    return self.pods.live

  @property
  def harness(self) -> Harness:
    return self.pods.harness

  @property
  def step_program(self):
    return self.pods.step_program

  # -- steps ----------------------------------------------------------------------------------

  def boundary(self, state: dict, step: int, data_position=dict) -> dict:
    """Before step `step` (0-based) is dispatched and its batch read (the trainer calls it
    before every `step`): the drills due there, and the lost pods whose islands can run again
    rejoin (remote: their workers answer; distributed: their new processes are ready).
    `data_position()`: the data position here, handed to a rejoining process."""
    self._drill(step + 1, "step")
    answering = self.controller.answering()
    # A pod that a later drill brings back waits for the drill's step (every mode).
    held = {d.pod for d in self._drills if d.action == "rejoin" and d.step > step + 1}
    for p in range(self.num_pods):
      if p not in self.live and p not in held:
        if all(i.name in answering for i in self._islands[p]):
          self._rejoining.add(p)  # remote: its workers answer again
    if self._agreement is not None:  # told alike on every live process (agreement.confirm)
      self._rejoining |= self._agreement.returning - held - set(self.live)
    if self._rejoining:
      state = self._rejoin(self.settle(state), step, data_position)
    return state

  def join(self) -> tuple[dict, int, dict]:
    """Distributed mode, in a process started in a dead one's place (processes.rejoining):
    once the live processes welcome it at a step boundary (agreement.join), its pod's state is
    copied from a live pod's, as they do in `_rejoin`. Returns (its state, the step (0-based)
    it starts at, the data position there)."""
    start = time.perf_counter()
    handover = self._agreement.join()
    survivors, welcomed = tuple(handover["live"]), handover["pods"]  # its own among them
    self.pods.harness_for(survivors)  # its islands are not theirs: nothing of its own compiles
    compile_s = self.pods.compiled_s
    self.pods.live = survivors
    live = tuple(sorted({*survivors, *welcomed}))  # pods still lost stay lost
    more_s, state = self.pods.move(live, cells.stand_ins(self.step_program))
    seconds, step = time.perf_counter() - start, handover["step"]
    self._record(
      "rejoin", welcomed, "this process started again", f"at step {step + 1}", seconds,
      compile_s=compile_s + more_s, state_s=seconds - compile_s - more_s,
    )  # fmt: skip
    return state, step, handover["data"]

  def step(self, state: dict, batch: dict, step: int) -> StepOutputs:
    """Dispatches step `step` (0-based) as Harness.step does, on the live pods; returns at
    once. Earlier steps are confirmed first (all but `backend.max_inflight_steps`), so `state`
    may be replaced by the state of their run again after a drop."""
    self._confirm(keep=self.config.backend.max_inflight_steps)
    state, metrics = self._current(state), Metrics(self)
    self._steps = step + 1
    began = time.perf_counter()  # a dispatch can itself wait on a silent worker until it is lost
    try:
      pending = self._dispatch(state, batch, step, metrics, began)
      self._drill(step + 1, "mid")
    except IslandLost as e:  # remote: a lost worker refused the step, maybe after a wait
      if not self._pending or self._pending[-1].step != step:
        self._pending.append(Pending(step, batch, state, None, metrics, dispatched_at=began))
      refused = self._pending[-1]
      # The steps before it may have run on the survivors, consuming the state they started
      # from: those are confirmed, not run again (one that failed drops the pods itself).
      confirms_here = self._agreement is None  # distributed: the processes confirm together
      while confirms_here and refused in self._pending and self._pending[0] is not refused:
        self._confirm_oldest()
      if not confirms_here or self._pending[0] is refused:
        self._drop(e)
      pending = self._pending[-1]
    self._given = pending.out.state
    return StepOutputs(self._given, pending.metrics)

  def settle(self, state: dict) -> dict:
    """Waits for every dispatched step, dropping lost pods and running failed steps again;
    the state after the last one."""
    self._confirm(keep=0)
    return self._current(state)

  def _current(self, state: dict) -> dict:
    """`state`, or the state of the pending steps run again if it is their failed one."""
    return self._head if state is self._given and self._head is not None else state

  def evaluate(self, state: dict, batches) -> dict[str, float]:
    """Harness.evaluate on the live pods: a pod lost while the evaluation runs (its nodes fail
    with IslandLost: remote, a dead worker refuses it; distributed, its process is found gone
    as in a step's agreement) is dropped as after a failed step, and the evaluation runs again
    on the survivors, whose sums are the uninterrupted run's (a hosted pod's batches run on its
    host; a rebuilt pod set's pods take its rows). Waits for it."""
    given, batches = state, list(batches)
    while True:
      state = self._current(given)
      try:
        futures = self.harness.dispatch_eval(state, batches)
        self._drill(self._steps, "eval")
        if self._agreement is not None:
          return eval_sums(self._agreement.evaluate(futures, self.live))
        return eval_sums(self.controller.read([f.result() for f in futures]))
      except IslandLost as e:
        self._drop(e, given, during="the evaluation", again="the evaluation runs again")

  def whole(self, state: dict) -> dict:
    """Harness.whole on the live pods: a pod lost while the state is read (remote: its worker
    dies or goes silent; embedded: its arrays were deleted) is dropped as after a failed step,
    and the survivors' state is read instead. Distributed mode reads as Harness does (its
    processes would have to agree on such a loss, as on a step's: agreement.py)."""
    given = state
    while True:
      state = self.settle(given)
      if self._agreement is not None:
        return self.step_program.to_checkpoint(results(state))
      try:
        return self.step_program.to_checkpoint(self.controller.read(results(state), fetch=False))
      except IslandLost as e:
        self._drop(e, given, during="the final read", again="the state is read again")

  def _dispatch(self, state, batch, step, metrics, began: float) -> Pending:
    """Dispatches the step; `began`: when its dispatch began (its pending step's date)."""
    host_metrics = self._agreement is None  # distributed: read once the processes agree
    out = self.harness.step(state, self._rows(batch), step, host_metrics=host_metrics)
    pending = Pending(step, batch, state, out, metrics, dispatched_at=began)
    self._pending.append(pending)
    self._head = out.state
    return pending

  def _rows(self, batch: dict) -> dict:
    """The rows the live pods take: all of them, or (fault.keep_global_batch=False) the live
    pods' own rows of the configured layout."""
    if self.config.fault.keep_global_batch or len(self.live) == self.num_pods:
      return batch
    n = len(batch["inputs"]) // self.num_pods
    rows = np.concatenate([np.arange(p * n, (p + 1) * n) for p in self.live])
    return {k: v[rows] for k, v in batch.items()}

  def _confirm(self, keep: int) -> None:
    """Confirms the oldest pending steps until `keep` remain: each one's metrics are read (so a
    lost pod is seen) and handed to the trainer with `pods_live`."""
    while len(self._pending) > keep:
      self._confirm_oldest()

  def _confirm_through(self, metrics: Metrics) -> None:
    while not metrics.done():
      self._confirm_oldest()

  def _confirm_oldest(self) -> None:
    if self._fatal is not None:  # too few pods were left: the run is over
      raise self._fatal
    pending, ran = self._pending[0], False
    try:
      if self._agreement is None:
        values = self.controller.read(pending.out.metrics.result())
        ran = self.controller.cluster.remote  # the reporting pod's update ran (`_drop`)
        self._copied(pending.out.state)  # whole: metrics may be ready before it, not enough
      else:
        values = self._agreement.confirm(pending.out, self.live)
    except IslandLost as e:
      self._drop(e, ran=ran)  # runs the pending steps again: the oldest is confirmed next time
      return
    self._pending.popleft()
    self._confirmed_at = time.perf_counter()
    pending.metrics.set_result({**values, "pods_live": np.int32(len(self.live))})

  # -- drop and rejoin ------------------------------------------------------------------------

  def _drop(self, error: IslandLost, given=None, during="", again="", ran=False) -> None:
    """Drops the lost pods and runs every pending step again on the survivors (the last one's
    state becomes the head). With no step pending (a loss `during` an evaluation, or a rejoin;
    `again`: what runs again), the state moved is the one of `given` (the trainer's), which
    then stands for it. `ran`: the oldest step's metrics were read (remote), so its update
    consumed the state it started from on the reporting pod: it cannot run again."""
    start = time.perf_counter()
    self.controller.wait()  # every dispatched step has run or failed
    lost_islands = self.controller.lost or {error.island: error.cause}
    lost = sorted({self._pod_of[i] for i in lost_islands} & set(self.live))
    if not lost or ran:  # nothing to drop (the same steps would fail again), or to run again
      # The live pods' state depends on a dropped pod (remote: a rejoin's copy from a pod lost
      # while it was made, or a step's pull from one): the loss itself, which the restart path
      # (fault.max_restarts) takes.
      log.error("the live pods %s read what a lost pod made (%s): they cannot go on without it",
                self.live, error)  # fmt: skip
      self._fatal = error
      raise error
    live = tuple(p for p in self.live if p not in lost)
    causes = [lost_islands.get(self._islands[p][0].name, error.cause) for p in lost]
    cause = "; ".join(dict.fromkeys(causes)) or error.cause  # each lost pod's, once
    if len(live) < max(self.config.fault.min_pods, 1):
      log.error(
        "pod %s lost (%s): %d of %d pods left, fewer than fault.min_pods=%d; stopping",
        ",".join(map(str, lost)),
        cause,
        len(live),
        self.num_pods,
        self.config.fault.min_pods,
      )
      self._fatal = error
      raise error
    detect_s = None if self._killed_at is None else start - self._killed_at  # a drill's
    self._killed_at = None
    before = self._pending[0].before if self._pending else self._current(given)
    compile_s, state = self.pods.move(live, before)
    redo = list(self._pending)
    self._pending.clear()
    if not redo:  # the trainer's state is now this one (`_current`)
      self._given, self._head = given, state
    moved = time.perf_counter() - start - compile_s
    at = f"during {during} after step {self._steps}" if during else f"after step {self._steps}"
    if redo:
      at = f"at step {redo[0].step + 1}"
      again = f"steps {redo[0].step + 1}-{redo[-1].step + 1} run again"
    # What the loss cost: the stall, from the last step confirmed (or the first failed one's
    # dispatch, if later) to the drop (the failed steps' first run and the detection), and the
    # drop itself, unless a badput block the run is in counts it already (an evaluation).
    since = max(self._confirmed_at, redo[0].dispatched_at) if redo else self._confirmed_at
    if self.goodput is not None and self.goodput.inside is None:
      self.goodput.add("stall", start - since if redo else 0.0)
      self.goodput.add("rerun", time.perf_counter() - start)
    self._record(
      "drop", lost, cause, at, time.perf_counter() - start, detect_s, again,
      stall_s=start - since, compile_s=compile_s, state_s=moved,
    )  # fmt: skip
    for i, pending in enumerate(redo):
      try:
        rerun = self._dispatch(state, pending.batch, pending.step, pending.metrics,
                               time.perf_counter())  # fmt: skip
        state = rerun.out.state
      except IslandLost as e:  # another pod lost on the way: the rest wait for the next drop
        self._pending.extend(Pending(p.step, p.batch, state, None, p.metrics) for p in redo[i:])
        self._drop(e)
        return

  def _rejoin(self, state: dict, step: int, data_position) -> dict:
    """Copies the live pods' state onto the returning pods at this step boundary."""
    start = time.perf_counter()
    pods = sorted(self._rejoining)
    self._rejoining.clear()
    if self._agreement is not None:  # their processes take on the live ones' counts
      handover = {"step": step, "live": list(self.live), "pods": pods, "data": data_position()}
      self._agreement.welcome(pods, handover)  # which clears their `returning`
    for p in pods:
      for island in self._islands[p]:
        self.controller.restore(island.name)
    was = self.live
    drill = functools.partial(self._drill, step + 1, "copy")  # once the copies' sources are set
    compile_s, moved = self.pods.move(tuple(sorted({*was, *pods})), state, before_copy=drill)
    try:
      self._copied(moved)
    except IslandLost as e:  # a pod lost while the state was copied: the pods live before go on
      self.pods.live = was
      gone = {self._pod_of[i] for i in self.controller.lost}
      if gone & set(was):
        what = f"pod {','.join(map(str, pods))}'s rejoin"
        self._drop(e, state, during=what, again="the rejoin copies from a live pod")
      self._rejoining.update(p for p in pods if p not in gone)  # again, at once
      state = self._current(state)
      return self._rejoin(state, step, data_position) if self._rejoining else state
    seconds = time.perf_counter() - start
    self._record(
      "rejoin", pods, "its islands run again", f"at step {step + 1}", seconds,
      compile_s=compile_s, state_s=seconds - compile_s,
    )  # fmt: skip
    return moved

  def _copied(self, state: dict) -> None:
    """Waits until every value of `state` (a step's, or one copied onto returning pods) is
    computed on every live pod, fetching nothing (remote: each worker's pulls from the others
    done); a piece that waited on a pod lost meanwhile fails with its IslandLost. Distributed
    mode's processes agree on it."""
    if self._agreement is None:
      self.controller.computed(state)

  def _drill(self, step: int, place: str) -> None:
    """The injected faults of `fault.inject` due at `place` (drills.PLACES) of step `step`
    (1-based): before it is dispatched, while it runs, or during the evaluation after it."""
    for drill in self._drills:
      if drill.step != step or drill.place != place:
        continue
      if drill.action in ("kill", "wedge") and drill.pod in self.live:
        if place == "step":  # the fault hits this step, not one still in flight
          self._confirm(keep=0)
          self.controller.wait()
        self._killed_at = time.perf_counter()
        name = f"{drill.action}:pod{drill.pod}@{place}{step}"
        if drill.action == "wedge":  # its islands compute forever, their processes alive
          wedge(self.controller, self._islands[drill.pod], name)
        elif self._agreement is not None:  # its process dies; the others find it gone
          self._agreement.kill(drill.pod, name)
        else:
          for island in self._islands[drill.pod]:
            self.controller.lose(island.name, f"fault.inject {name}")
      elif drill.action == "rejoin" and drill.pod not in self.live:
        if self._agreement is not None:  # its new process: at this step, once it is ready
          self._agreement.await_ready(drill.pod)
        self._rejoining.add(drill.pod)

  def _record(self, kind, pods, cause, at, seconds, detect_s=None, again="", stall_s=None,
              **parts):  # fmt: skip
    """A drop's or a rejoin's log line (lines.py), `at` where it happened; `parts`: its seconds
    by cause; `stall_s`: a drop's stall. A rejoin's seconds are badput of the degraded run it
    ends (a drop's: `_drop`)."""
    if kind == "rejoin" and self.goodput is not None and self.goodput.inside is None:
      self.goodput.add("degraded", seconds)
    event = dict(kind=kind, pods=pods, cause=cause, at=at, live=len(self.live), again=again,
                 num_pods=self.num_pods, seconds=seconds, detect_s=detect_s,
                 stall_s=stall_s)  # fmt: skip
    hosts = getattr(self.step_program, "hosts", {}) if kind == "drop" else {}
    log.warning("%s", lines.line(event, parts, hosts))
