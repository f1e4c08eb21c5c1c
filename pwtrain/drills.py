"""Fault drills (`fault.inject`) and the checks of the elastic pods' settings (fault.*).

A drill is a fault a user (or a test) asks for: `kill:pod1@step6` loses pod 1's islands before
step 6 is dispatched (embedded: as if their devices had failed; remote: their workers' processes
are SIGKILLed; distributed: its process SIGKILLs itself); `kill:pod1@mid6` while step 6 runs
(once it is dispatched, before it is confirmed); `kill:pod1@eval6` during the evaluation after
step 6 (once its batches are dispatched); `kill:pod0@copy10` while a rejoin before step 10
copies the live pods' state (embedded mode); `rejoin:pod1@step10` brings the pod back before
step 10, not earlier (remote: waits until its workers answer again; distributed: waits until
the process pwtrain.launch started again in the pod's place is ready); `wedge:pod1@step4` makes
pod 1's execution stop making progress before step 4 is dispatched, its processes alive and
answering: its islands run a computation that never ends (elastic/wedge.py), found wedged after
`fault.progress_timeout_s` (remote: by the health monitor, which kills the worker the run
launched; distributed: the process ends itself; embedded mode refuses the drill). Kills at the
same place happen together (two pods at once). An embedded kill deletes the arrays on the pod's
devices, as a real loss leaves them. pwtrain/elastic/ carries them out.
"""

import dataclasses
import re

from pwtrain.errors import ConfigError

_DRILL = re.compile(r"^(kill|rejoin|wedge):pod(\d+)@(step|mid|eval|copy)(\d+)$")
# Where a drill's event happens, by step N: before it is dispatched, while it runs, during the
# evaluation after it, or while a rejoin before it copies the live pods' state (embedded).
PLACES = ("step", "mid", "eval", "copy")


@dataclasses.dataclass(frozen=True)
class Drill:
  """One injected event of `fault.inject`: `action` ("kill", "rejoin" or "wedge") of configured pod
  `pod` at `place` (PLACES) of step `step` (1-based, as metrics rows count)."""

  action: str
  pod: int
  step: int
  place: str = "step"


def check(config, plan) -> None:
  """fault.* against the plan, before anything is written: every pod count the run may fall to
  (fault.min_pods up to parallel.pods) must split its batch evenly."""
  f = config.fault
  if not f.elastic:  # fault.inject is then refused by config validation (conditions.py)
    return
  drills = parse_inject(f.inject, plan.num_pods)
  wedges = any(d.action == "wedge" for d in drills)
  if wedges and config.backend.mode == "embedded":
    raise ConfigError(
      f"fault.inject={f.inject!r}: 'wedge:' is not a drill of backend.mode='embedded': every "
      "pod computes in the controller's own process, which nothing can unwedge from inside; use "
      "'kill:' there, or backend.mode='remote' or 'distributed'"
    )
  if wedges and config.backend.mode == "remote" and not config.backend.launch_workers:
    raise ConfigError(
      f"fault.inject={f.inject!r}: 'wedge:' in backend.mode='remote' takes "
      "backend.launch_workers=True: a wedged worker is killed and relaunched only by the run "
      "that launched it (one started outside the run would stay wedged); use 'kill:' there"
    )
  if plan.num_pods < 2:
    raise ConfigError(
      f"fault.elastic=True drops lost pods, but parallel.pods={plan.num_pods}: use 2 or more"
    )
  if not 1 <= f.min_pods <= plan.num_pods:
    raise ConfigError(f"fault.min_pods={f.min_pods} must be between 1 and parallel.pods")
  split = plan.batch_shards * config.train.num_microbatches
  for n in range(f.min_pods, plan.num_pods + 1):
    batch = config.train.global_batch
    if not f.keep_global_batch:
      batch = batch * n // plan.num_pods
    if batch % (n * split):
      raise ConfigError(
        f"fault.elastic=True with {n} live pods: train.global_batch={batch} does not split "
        f"into {n} pods x {split} rows (batch shards x microbatches); choose a global batch "
        f"that every pod count from fault.min_pods={f.min_pods} to {plan.num_pods} divides"
      )
  if config.backend.mode == "distributed":
    _check_distributed(config, plan, drills)


def _check_distributed(config, plan, drills) -> None:
  """What elastic pods take in distributed mode (elastic/agreement.py): one island per pod, each
  on one process of its own (the process is what dies), the sync exchange, and drills of pods
  other than pod 0 (process 0 serves the coordination service)."""
  where = "fault.elastic=True in backend.mode='distributed'"
  if config.parallel.stages != 1:
    raise ConfigError(
      f"parallel.stages={config.parallel.stages}: {where} takes one island per pod "
      "(parallel.stages=1); pipelines within pods are elastic in embedded and remote modes"
    )
  if config.exchange.mode != "sync":
    raise ConfigError(
      f"exchange.mode={config.exchange.mode!r}: {where} takes exchange.mode='sync' (stale "
      "carries its gradient between processes by cross-host device_put, which cannot leave a "
      "dead process out; overlapped and diloco are not built there)"
    )
  for drill in drills:
    if drill.place == "copy":
      raise ConfigError(
        f"fault.inject={config.fault.inject!r}: {where} takes no drill at a rejoin's copy "
        "(@copy<N>: embedded mode's; the processes agree on a rejoin before its copy)"
      )
    if drill.pod == 0:
      raise ConfigError(
        f"fault.inject={config.fault.inject!r}: {where} takes drills of pods P >= 1 "
        "(pod 0's process serves the coordination service, whose loss restarts the run)"
      )
  owners = [island.processes for island in plan.islands]
  if any(len(o) != 1 for o in owners) or len(set(owners)) != len(owners):
    raise ConfigError(
      f"parallel.pods={plan.num_pods}: {where} drops a pod with its process, so each pod must "
      f"be one process of its own, but the pods' islands are on processes "
      f"{[sorted(o) for o in owners]}: start as many processes as pods "
      f"(python -m pwtrain.launch --nproc={plan.num_pods})"
    )


def parse_inject(text: str, num_pods: int) -> tuple[Drill, ...]:
  """`fault.inject`: comma-separated `kill:pod<P>@<place><N>`, `rejoin:pod<P>@step<N>` and
  `wedge:pod<P>@step<N>`."""
  drills = []
  for item in filter(None, (part.strip() for part in str(text).split(","))):
    match = _DRILL.match(item)
    if match is None or (match.group(1) != "kill" and match.group(3) != "step"):
      raise ConfigError(
        f"fault.inject={text!r}: {item!r} is not 'kill:pod<P>@<place><N>' (place: step, mid, "
        "eval or copy), 'rejoin:pod<P>@step<N>' or 'wedge:pod<P>@step<N>' (e.g. "
        "'kill:pod1@step6,rejoin:pod1@step10')"
      )
    action, pod, place, step = match[1], int(match[2]), match[3], int(match[4])
    if pod >= num_pods or step < 1:
      raise ConfigError(
        f"fault.inject={text!r}: {item!r} needs a pod below parallel.pods={num_pods} and a step "
        ">= 1"
      )
    drills.append(Drill(action, pod, step, place))
  return tuple(drills)
