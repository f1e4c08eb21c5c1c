"""The pod sets an elastic run steps over (steps.py): for each set of live pods, its harness,
and the train state moved from one set's program onto another's.

A set's harness is one of two kinds:
  hosted   the full pod set's program with each lost pod hosted by live pods
           (PipelineProgram.hosted): their islands run the lost pod's microbatches with the
           executables they have, so nothing compiles, every pod keeps its number, and the
           trajectory is the uninterrupted run's. The lost pods' microbatches are shared out
           over the live pods: with at least as many microbatches as live pods each takes
           about an equal share; with fewer, some live pods take one more microbatch each.
           Used where it can be: `fault.host_lost_pods`, the global batch kept, and the pods'
           states equal (not DiLoCo, no error feedback); any pod may be hosted, pod 0 too (the
           lowest live pod then reports the metrics, with pieces compiled for it at the start).
  rebuilt  a plan and step program laid out for the live pods alone, numbered 0, 1, ... in
           pod order on their own islands, each taking an equal share of the batch: compiled
           the first time the set is used, then cached.
"""

import copy
import dataclasses
import functools

import jax

from pwtrain.backend import Cluster, Program, Transfer
from pwtrain.backend.run_mode import results
from pwtrain.elastic import cells
from pwtrain.harness import Harness


class PodSets:
  """The run's pod sets, starting from every configured pod live (`harness`'s). `islands`:
  {configured pod: its islands}; `agreement`: distributed mode's (agreement.py), else None."""

  def __init__(self, config, harness: Harness, islands: dict, agreement=None):
    self.config = config
    self.num_pods = len(islands)
    self._islands = islands
    self._agreement = agreement
    self.live = tuple(range(self.num_pods))
    self._harnesses = {self.live: harness}
    self.compiled_s = 0.0  # what the last harness_for compiled
    # Pod set -> {configured pod: its pod number in that set's program}.
    self._numbers = {self.live: {p: p for p in self.live}}

  @property
  def harness(self) -> Harness:
    return self._harnesses[self.live]

  @property
  def _full(self) -> Harness:
    """The harness of every configured pod: the run's own."""
    return self._harnesses[tuple(range(self.num_pods))]

  @property
  def step_program(self):
    return self.harness.step_program

  def hosts(self, live: tuple) -> dict | None:
    """{lost pod: the live pod hosting each of its microbatches} where pod set `live` is
    hosted, else None. The lost pods' microbatches, in pod order, are cut into as many
    contiguous runs as there are live pods, one each: with at least as many microbatches as
    live pods every live pod takes about an equal share (else the first ones take one each)."""
    fault = self.config.fault
    if not (
      fault.host_lost_pods
      and fault.keep_global_batch
      and getattr(self._full.step_program, "can_host", False)
    ):
      return None
    micro = self.config.train.num_microbatches
    work = [(q, m) for q in range(self.num_pods) if q not in live for m in range(micro)]
    hosts = {q: [0] * micro for q, _ in work}
    for k, (q, m) in enumerate(work):
      hosts[q][m] = live[k * len(live) // len(work)]
    return {q: tuple(pods) for q, pods in hosts.items()}

  def harness_for(self, live: tuple) -> Harness:
    """The harness of pod set `live`: hosted, or rebuilt (compiled the first time), cached;
    `compiled_s` is what this call compiled (0: hosted, or cached)."""
    self.compiled_s = 0.0
    if live in self._harnesses:
      return self._harnesses[live]
    hosts = self.hosts(live)
    if hosts is not None:
      program = self._full.step_program.hosted(hosts)
      harness = dataclasses.replace(
        self._full, step_program=program, owns_cluster=False, owns_controller=False
      )
      self._numbers[live] = {p: p for p in live}
    else:
      config = copy.deepcopy(self.config)
      config.parallel.pods = len(live)
      config.parallel.islands = len(live) * config.parallel.stages
      if not config.fault.keep_global_batch:
        config.train.global_batch = self.config.train.global_batch * len(live) // self.num_pods
      cluster = Cluster(tuple(i for p in live for i in self._islands[p]))
      controller = self.harness.controller
      harness = Harness.build(config, cluster=cluster, controller=controller)
      self.compiled_s = harness.compile_s
      self._numbers[live] = {p: i for i, p in enumerate(live)}
    self._harnesses[live] = harness
    return harness

  def move(self, live: tuple, state: dict, before_copy=None) -> tuple[float, dict]:
    """(seconds compiling (0 unless a rebuilt pod set is made), `state` of the current pod set
    laid out on pod set `live`), which
    then becomes the current one. A pod in both keeps its cells' state where it is (nothing
    moves); a returning pod gets a copy of the first live pod's, device to device
    (`before_copy()` is called first: a drill). Where the cells differ (down to one pod, whose
    exchange carries nothing), the state goes through the whole-model form instead
    (`from_checkpoint`)."""
    harness = self.harness_for(live)
    compile_s = self.compiled_s
    old, new = self.step_program, harness.step_program
    was, now = self._numbers[self.live], self._numbers[live]
    first = was[self.live[0]]
    sources = {now[p]: was.get(p, first) for p in live}  # each new pod's state: whose
    same = {now[p]: p in self.live for p in live}
    moved = cells.keep_cells(old, new, state, sources, same)
    if moved is not None:  # the returning pods' cells: copied from a live pod's islands
      if before_copy is not None and any(isinstance(v, cells.Copy) for v in moved.values()):
        before_copy()
      moved = self._copy_cells(harness.plan, moved)
    else:
      whole = self._whole(state, keep=sorted(set(sources.values())))
      moved = new.from_checkpoint(cells.for_pods(whole, new, getattr(new, "num_pods", 1)))
    self.live = live
    return compile_s, moved

  def _copy_cells(self, plan, moved: dict) -> dict:
    """`moved` ({state key: value, or a `cells.Copy`}) with each copy made onto its cell's
    island in `plan` (the new pod set's), by one program of transfers: device to device
    (embedded), worker to worker (remote), never through this process."""
    if self._agreement is not None:  # distributed: one pull each (cells.hand_over)
      controller = self.harness.controller
      copy_one = functools.partial(cells.hand_over, controller, plan)
      return {k: copy_one(v) if isinstance(v, cells.Copy) else v for k, v in moved.items()}
    nodes, inputs, outputs = [], {}, {}
    for key, value in moved.items():
      if not isinstance(value, cells.Copy):
        continue
      island = plan.cells[value.cell].name
      inputs[f"from/{key}"] = value.value
      nodes.append(Transfer(f"copy/{key}", f"from/{key}", island, value.shardings))
      outputs[key] = (f"copy/{key}", 0)
    if not nodes:
      return moved
    return {**moved, **self.harness.controller.run(Program(tuple(nodes), outputs), inputs)}

  def _whole(self, state: dict, keep: list[int]) -> dict:
    """The whole-model state of the current program's pods `keep` (its pod numbers): one of
    them, or each one's where the pods' states differ."""
    program = self.step_program
    if hasattr(program, "pod_whole"):  # only the kept pods' cells: a lost pod's may have failed
      state = {k: v for k, v in state.items() if cells.pod_of_key(k) in keep}
    state = results(state)
    for leaf in jax.tree.leaves(state):
      if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise RuntimeError("the survivors' state was consumed by the failed step; cannot drop")
    if not hasattr(program, "pod_whole"):  # one pod on one island
      return program.to_checkpoint(state)
    if program.per_pod_checkpoint:
      return {"pods": [program.pod_whole(state, p) for p in keep]}
    return program.pod_whole(state, keep[0])
