"""The state layout of an MPMD step: one train state per cell, keyed "state/<pod>.<stage>".

A cell's state is the stage's share of the whole-model state (stages.to_stage); checkpoints
hold the whole model (stages.to_whole), every pod's when the pods' states differ. Every leaf of
the whole-model restore target is sharded on pod 0's island of the stage that owns it (shared
leaves on the first), and `from_checkpoint` copies it wherever else it is used. With scanned
layers a cell's state holds its periods stacked while checkpoints hold every layer unrolled:
`to_checkpoint` unstacks on each island, `from_checkpoint` stacks each stage's layers there.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax

from pwtrain import step as step_lib
from pwtrain.backend import Program
from pwtrain.parallel.exchange import Exchange
from pwtrain.parallel.stages import Stage, stack_state, to_stage, to_whole


def state_key(cell: tuple) -> str:
  return f"state/{cell[0]}.{cell[1]}"


@dataclasses.dataclass
class PipelineProgram:
  """The StepProgram (parallel/program.py) of stages and pods over islands."""

  programs: dict[str, Program]  # "step", and the exchange's other kinds (DiLoCo: "outer")
  build_programs: Callable[[dict], dict]  # hosts -> `programs` with those pods hosted (hosted)
  build_eval: Callable[[dict], Program]  # hosts -> the forward-only program (eval_program)
  abstract_state: dict  # whole-model state (every pod's, when they differ): restore target
  init: Callable[[], dict]  # () -> {"state/<p>.<s>": cell state}
  executables: dict  # (kind, pod, stage) -> Executable
  stages: list[Stage]
  num_pods: int
  num_micro: int
  cell_shardings: dict  # (p, s) -> state shardings
  exchange: Exchange
  exchange_bytes: int  # bytes each pod sends to the other pods per (outer) step
  period: int = 0  # scanned layers: layers per stacked period (models/scan.py); 0: unrolled
  hosts: dict = dataclasses.field(default_factory=dict)  # {pod: host per microbatch} (hosted)
  columns: tuple = ("inputs", "targets")  # the batch's columns (the objective's)

  @property
  def program(self) -> Program:
    return self.programs["step"]

  @property
  def per_pod_checkpoint(self) -> bool:
    return self.exchange.per_pod_state

  @property
  def state_keys(self) -> tuple:
    return tuple(state_key(c) for c in self.cell_shardings)

  def program_for(self, step: int) -> Program:
    return self.programs[self.exchange.program_kind(step)]

  @functools.cached_property
  def eval_program(self) -> Program:
    return self.build_eval(self.hosts)

  @property
  def can_host(self) -> bool:
    """Whether a pod can be hosted by another (`hosted`): the pods' states are equal."""
    return self.num_pods > 1 and not self.exchange.per_pod_state

  def hosted(self, hosts: dict[int, tuple]) -> "PipelineProgram":
    """This program with each pod of `hosts` ({pod: its host pod for each microbatch}) run by
    live pods: host m's islands run the pod's microbatch m with their own executables on their
    own state, the pod's running sums follow its microbatches, and its gradients and
    statistics are summed as its own would be, in pod order (pipeline/wiring.py); the lowest
    pod with state reports the metrics (pod 0's are the same: the pods' states are). Nothing is
    compiled (elastic pods compile every pod's reporting pieces), and the trajectory is the one
    of every pod running. The hosted pods keep no state: `state_keys`, `to_checkpoint` and
    `from_checkpoint` cover the others. Only where `can_host`."""
    used = {h for pods in hosts.values() for h in pods}
    assert self.can_host and not used & set(hosts) and len(hosts) < self.num_pods
    assert all(len(pods) == self.num_micro for pods in hosts.values())
    return dataclasses.replace(
      self,
      programs=self.build_programs(hosts),
      cell_shardings={c: v for c, v in self.cell_shardings.items() if c[0] not in hosts},
      hosts=dict(hosts),
    )

  def feed(self, batch: dict) -> dict:
    """Host batch -> per-pod, per-microbatch inputs.

    Pod p takes the p-th contiguous slice of the global batch; within it rows m, m+M, ... form
    microbatch m (as gradient accumulation does). Column "inputs" goes in as "tokens/<p>.<m>",
    every other column c (the objective's labels) as "c/<p>.<m>".
    """
    out = {}
    for key, rows in self.feed_rows(len(batch["inputs"])).items():
      name = key.split("/")[0]
      column = batch["inputs" if name == "tokens" else name]
      out[key] = column[rows.start : rows.stop : rows.step]
    return out

  def feed_rows(self, num_rows: int) -> dict[str, range]:
    out = {}
    names = ["tokens" if c == "inputs" else c for c in self.columns]
    for p in range(self.num_pods):
      pod = range(p * num_rows // self.num_pods, (p + 1) * num_rows // self.num_pods)
      for m in range(self.num_micro):
        for name in names:
          out[f"{name}/{p}.{m}"] = pod[m :: self.num_micro]
    return out

  def pod_whole(self, state: dict, p: int) -> dict:
    """Pod `p`'s whole-model state, layers unrolled."""
    return to_whole([state[state_key((p, s))] for s in range(len(self.stages))], self.stages)

  def to_checkpoint(self, state: dict) -> dict:
    if self.per_pod_checkpoint:
      return {"pods": [self.pod_whole(state, p) for p in range(self.num_pods)]}
    first = min(p for p, _ in self.cell_shardings)  # pod 0, unless it is hosted
    return self.pod_whole(state, first)  # pods hold identical states

  def from_checkpoint(self, whole: dict) -> dict:
    out = {}
    for cell, shardings in self.cell_shardings.items():
      pod = whole["pods"][cell[0]] if self.per_pod_checkpoint else whole
      state = to_stage(pod, self.stages[cell[1]])
      if self.period:  # stacked on the island the checkpoint's layers were read onto
        state = stack_state(state, self.period)
      # A copy each: cells on one island (interleaved chunks, overlapped buckets) would
      # otherwise share the leaves already laid out there (a step count), and one cell's
      # update, which donates its state, would delete the other's.
      out[state_key(cell)] = jax.device_put(state, shardings, may_alias=False)
    return out


def whole_abstract(cell_abstract: dict, stages: list, num_pods: int, per_pod: bool):
  """The restore target: the whole-model state (unrolled, ShapeDtypeStructs), each leaf sharded
  as its cell has it."""

  def pod(p):
    return to_whole([cell_abstract[(p, s)] for s in range(len(stages))], stages)

  if per_pod:
    return {"pods": [pod(p) for p in range(num_pods)]}
  return pod(0)


def train_state(
  fns, tx, seed: int, exchange: Exchange, params=None, *, reference: bool = False
) -> dict:
  """The whole-model train state, with what the exchange carries (stale gradients, DiLoCo's
  anchor, error-feedback residuals); `params` given, those; `reference`: with the reference
  policy (step_lib.init_state)."""
  state = step_lib.init_state(fns, tx, seed, params, reference=reference)
  return {**state, **exchange.init_state(state["params"])}
