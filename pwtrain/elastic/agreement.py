"""Elastic pods in distributed mode: the processes agree, step by step, on the live pods.

Every process walks every program, so a pod can only be dropped if every surviving process
drops it at the same step; and a step may have finished on some processes and failed on others
(a pod's process died after one survivor pulled its gradients and before another did). Each pod
is one process of its own (drills.check), process 0 holding pod 0. The runtime is JAX's
fault-tolerant one (`jax_enable_recoverability`, a heartbeat timeout of 3 x fault.heartbeat_s:
backend/distributed.py), so a process that dies does not take the others with it.

  confirm   a step is confirmed on every process in the same order: each waits for its own
            share of the step (its island's new state; process 0: the metrics too), which fails
            at once where a transfer pulled from a dead process failed, then tells whether it
            ran, in one `processes.agree` over the live pods' processes: its word, then JAX's
            live-nodes barrier, which every survivor leaves with the same live set (a dead
            process is left out once its heartbeats are missed). So all survivors see the same
            answer: the step ran on every live process (its metrics are then read on all,
            processes.to_host), or processes are gone (dead, or started again under a new
            incarnation), whose pods are lost (`IslandLost`): steps.py drops them and runs this
            step and those after it again on the survivors. A step that failed while every
            process is live is the program's error, raised as it is.
  no loss   steps compile without donating their inputs (Harness: `Controller(donate=False)`),
            so every survivor still holds the state each unconfirmed step started from, also
            where the step finished there.
  saves     the gone processes are left out of the run's live processes (processes.leave_out),
            so the survivors' checkpoints are ordinary ones: their barriers, the data positions'
            gather and Orbax's manager span the survivors (checkpoint/checkpointer.py).
  rejoin    pwtrain.launch starts a dead process again (same id, $PWTRAIN_REJOIN) once the
            others have left it out. It builds its programs, starts its transfer server (its
            address replaces its predecessor's), says it is ready (`join`) and waits. Process 0
            tells the live processes so in the next `confirm`, and at the next step boundary
            (before the batch is read) they hand it, through the key-value store, everything
            they pair by counting: the program number (which names every pull), every
            `processes.next_key` count, the live processes' generation, Orbax's count of save
            operations, the step, the live pods and the data position (`welcome`); it takes
            them on, all meet in one `processes.agree` of every process (its new incarnation
            taken), its pod's state is pulled from a live pod's process (cells.hand_over), and
            every pod runs again. It never enters a barrier its predecessor passed (one it
            would wait at alone), nor sets a key its predecessor set without deleting it first.
  drill     `kill:podP@stepN`: pod P's process SIGKILLs itself before step N is dispatched, once
            every earlier step is confirmed; the others find it gone as a real fault.
            `rejoin:podP@stepN`: the live processes wait at step N until its new process is
            ready (and do not take it back earlier), then welcome it there.
  never     process 0 serves JAX's coordination service: if it dies the others cannot go on,
            and the launcher restarts the run from the last checkpoint.
"""

import logging
import os
import re
import signal
import time

import jax

from pwtrain import console, processes
from pwtrain.backend import distributed
from pwtrain.backend.faults import IslandLost
from pwtrain.backend.scheduler import here_only
from pwtrain.checkpoint import process_parts
from pwtrain.harness import StepOutputs

log = logging.getLogger(__name__)

_REPEATED = re.compile(r"^(INTERNAL: )?(Error dispatching computation: )+")


class Agreement:
  """The live pods' processes agreeing on each step (see the module doc). Every process of the
  run makes one, at the same point (its first barrier takes every process's incarnation)."""

  def __init__(self, plan, controller, num_stages: int):
    self.controller = controller
    self._islands = {
      p: plan.islands[p * num_stages : (p + 1) * num_stages] for p in range(plan.num_pods)
    }
    # drills.check: every pod's islands are on one process of its own.
    self.process_of = {p: _process(islands) for p, islands in self._islands.items()}
    self.returning: set[int] = set()  # pods whose new process is ready to rejoin (`confirm`)
    self._incarnations: dict[int, int] = {}  # a rejoining process learns them in `join`
    if not processes.rejoining():
      told = processes.agree(processes.next_key("elastic/join"), "", self.process_of.values())
      self._incarnations = {i: incarnation for i, (incarnation, _) in told.items()}

  def confirm(self, out: StepOutputs, live: tuple[int, ...]) -> dict:
    """The host metrics of the step `out` dispatched over pods `live`, once every live pod's
    process has said it ran; raises `IslandLost` (after `controller.lose` of every lost pod's
    islands) when processes are gone. Process 0 also tells which lost pods' processes were
    started again and are ready to rejoin: they join `returning` on every live process alike."""
    said = {"error": _local_error(out), "ready": []}
    if jax.process_index() == 0:
      lost = [p for p in self.process_of if p not in live]
      said["ready"] = [p for p in lost if processes.told(_ready(self.process_of[p])) == "ready"]
    key = processes.next_key("elastic/step")
    told = processes.agree(key, said, [self.process_of[p] for p in live])
    gone = [
      p
      for p in live
      if told.get(self.process_of[p], (None,))[0] != self._incarnations[self.process_of[p]]
    ]
    failed = {i: said["error"] for i, (_, said) in told.items() if said["error"]}
    if 0 in told:
      self.returning.update(told[0][1]["ready"])
    if gone:
      raise self._lost(gone, told, failed)
    if failed:
      detail = "; ".join(f"process {i}: {said}" for i, said in failed.items())
      raise RuntimeError(f"a step failed while every process is live ({detail})")
    return processes.to_host(out.metrics.result(), processes.next_key("metrics"))

  def _lost(self, pods: list[int], told: dict, failed: dict) -> IslandLost:
    seen = next(iter(failed.values()), "")
    # From now on the run's barriers (checkpoints' included) wait for the survivors only.
    processes.leave_out(self.process_of[p] for p in pods if self.process_of[p] != 0)
    for p in pods:
      i = self.process_of[p]
      if i == 0:
        raise RuntimeError("process 0 (the coordination service) was lost: the run restarts")
      left = "was started again" if i in told else "left the run (no heartbeat)"
      cause = f"process {i} {left}" + (f"; a step failed with: {seen}" if seen else "")
      for island in self._islands[p]:
        self.controller.lose(island.name, cause)
    first = self._islands[pods[0]][0].name
    return IslandLost(first, self.controller.lost[first])

  # -- rejoin -------------------------------------------------------------------------------

  def await_ready(self, pod: int, timeout_s: float = 600.0) -> None:
    """The drill `rejoin:pod<pod>@step<N>`: waits until pod's new process is ready to rejoin
    (every live process alike, so they all welcome it at step N)."""
    deadline = time.monotonic() + timeout_s
    while processes.told(_ready(self.process_of[pod])) != "ready":
      if time.monotonic() > deadline:
        raise RuntimeError(f"pod {pod}'s process is not ready to rejoin after {timeout_s:.0f} s")
      time.sleep(0.2)

  def welcome(self, pods: list[int], handover: dict) -> None:
    """The live processes, at a step boundary: hand the new processes of `pods` (ready: `join`)
    what they must take on to pair with them (`handover`, with this process's counts: the
    same on every live process), then meet them, take them back and connect to their new
    transfer servers."""
    new = [self.process_of[p] for p in pods]
    handover = {
      **handover,
      "membership": processes.membership(),
      "program": self.controller.program_number,
      "orbax_operations": process_parts.operations(),
    }
    if jax.process_index() == 0:
      for i in new:
        processes.tell(_handover(i), handover)
    self._meet(new)
    for i in new:
      self.controller.forget(i)

  def join(self, timeout_s: float = 600.0) -> dict:
    """A process started in a dead one's place (processes.rejoining), once it has compiled its
    programs: starts its transfer server (its address replaces its predecessor's), says it is
    ready, waits for the live processes' handover (`welcome`), takes on their counts (program
    numbers, `processes.next_key`'s, Orbax's) and meets them. Returns the handover."""
    me = jax.process_index()
    self.controller.serve_pulls()
    processes.tell(_ready(me), "ready")
    handover = processes.hear(_handover(me), timeout_s)
    if handover.get("over"):  # the others finished first (`end_of_run`): leave with them
      log.warning("the run ended before this process could rejoin it")
      distributed.leave()
      logging.shutdown()
      console.flush()
      os._exit(0)
    processes.adopt(handover["membership"])
    self.controller.program_number = handover["program"]
    process_parts.adopt_operations(handover["orbax_operations"])
    self._meet([me])
    return handover

  def _meet(self, new: list[int]) -> None:
    """Every live process and the new ones `new` meet (their incarnations taken), and from now
    on all count as live (processes.take_back)."""
    everyone = sorted(set(processes.live()) | set(new))
    told = processes.agree(f"elastic/rejoin/{processes.generation()}", "", everyone)
    missing = sorted(set(everyone) - set(told))
    if missing:
      raise RuntimeError(f"process(es) {missing} left while rejoining; the run restarts")
    self._incarnations = {i: incarnation for i, (incarnation, _) in told.items()}
    if jax.process_index() == 0:
      for i in new:
        processes.tell(_ready(i), "taken")  # a later process in its place says so anew
    processes.take_back(new)
    self.returning.difference_update(p for p, i in self.process_of.items() if i in new)

  def kill(self, pod: int, step: int) -> None:
    """The drill `kill:pod<pod>@step<step>`: that pod's process SIGKILLs itself; elsewhere
    nothing happens (the others find it gone)."""
    if jax.process_index() != self.process_of[pod]:
      return
    log.warning("fault.inject kill:pod%d@step%d: this process SIGKILLs itself", pod, step)
    logging.shutdown()
    time.sleep(0.1)  # the launcher's echo reads the line before the process is gone
    os.kill(os.getpid(), signal.SIGKILL)


def end_of_run() -> None:
  """Process 0, as the run ends: a process started again that waits to rejoin is told that the
  run is over (`join`), so that it leaves with the others."""
  if jax.process_index() == 0:
    for i in set(range(jax.process_count())) - set(processes.live()):
      processes.tell(_handover(i), {"over": True})


def _handover(process: int) -> str:
  """The key of what the live processes hand `process`, started again (`welcome`)."""
  return f"elastic/handover/{process}"


def _ready(process: int) -> str:
  """The key under which `process`, started again, says it is ready to rejoin."""
  return f"elastic/ready/{process}"


def _process(islands) -> int:
  (process,) = {i for island in islands for i in island.processes}
  return process


def _local_error(out: StepOutputs) -> str:
  """The first line of the error of this process's share of the step; empty if it ran."""
  try:
    for future in (*out.state.values(), out.metrics):
      value = future.result() if hasattr(future, "result") else future
      jax.block_until_ready(here_only(value))
  except Exception as e:  # noqa: BLE001 - told to the others, who decide together
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # A failed pull's error, as every computation downstream of it repeats it.
    return _REPEATED.sub("", text)[:300]
  return ""
