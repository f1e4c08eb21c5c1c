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
  saves     process 0 saves alone (RunMode.sole_writer): pod 0 holds the whole model's replica
            and it reads every data stream, so no save waits for another process, and one that
            dies while a save is written changes nothing of it. The gone processes are left out
            of the run's live processes (processes.leave_out): barriers span the survivors.
  rejoin    pwtrain.launch starts a dead process again (same id, $PWTRAIN_REJOIN) once
            process 0 has told it that the others left it out (processes.tell_launcher): one
            started while they may still be in a live-nodes barrier over its id would be live
            there without entering it, and they would wait forever. It builds its programs,
            starts its transfer server (its address replaces its predecessor's), says it is
            ready (`join`) and waits. Process 0 tells the live processes so in the next
            `confirm`, and at the next step boundary (before the batch is read) they hand it,
            through the key-value store, everything they pair by counting: the program number
            (which names every pull), every `processes.next_key` count, the live processes'
            generation, the step, the live pods and the data position (`welcome`); it takes
            them on, all meet in one `processes.agree` of every process (its new incarnation
            taken), its pod's state is pulled from a live pod's process (cells.hand_over), and
            every pod runs again. It never enters a barrier its predecessor passed (one it
            would wait at alone), nor sets a key its predecessor set without deleting it first.
  drill     `kill:podP@stepN`: pod P's process SIGKILLs itself before step N is dispatched, once
            every earlier step is confirmed (`@midN`: once step N is dispatched; `@evalN`: once
            the evaluation after it is); the others find it gone as a real fault.
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
import numpy as np

from pwtrain import console, liveness, processes
from pwtrain.backend import distributed
from pwtrain.backend.faults import IslandLost
from pwtrain.backend.scheduler import here_only
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
    told = self._agree("elastic/step", said, live)
    if 0 in told:
      self.returning.update(told[0][1]["ready"])
    return processes.to_host(out.metrics.result(), processes.next_key("metrics"))

  def evaluate(self, futures: list, live: tuple[int, ...]) -> list[dict]:
    """The host partial sums of an evaluation dispatched over pods `live` (`futures`, in
    program-output order; Harness.dispatch_eval), once every live pod's process has told the
    sums its own islands computed: each reads its own and tells them in one `processes.agree`
    (no process waits for another's value: a dead one is left out by the barrier). Raises
    `IslandLost` when processes are gone, as `confirm` does."""
    said = {"error": "", "parts": {}}
    try:
      for i, future in enumerate(futures):
        value = future.result()
        if all(here_only(x) for x in jax.tree.leaves(value)):  # computed on this process
          said["parts"][i] = {k: float(np.asarray(v)) for k, v in value.items()}
    except Exception as e:  # noqa: BLE001 - told to the others, who decide together
      said["error"] = _first_line(e)
    told = self._agree("elastic/eval", said, live)
    parts = {int(i): part for _, (_, their) in told.items() for i, part in their["parts"].items()}
    return [parts[i] for i in range(len(futures))]

  def _agree(self, what: str, said: dict, live: tuple[int, ...]) -> dict:
    """`processes.agree` of the live pods' processes on `said` (with its "error": "" where this
    process's share ran); raises `IslandLost` (after `controller.lose` of every lost pod's
    islands) when processes are gone, or the error when one failed while every one is live."""
    told = processes.agree(processes.next_key(what), said, [self.process_of[p] for p in live])
    gone = [
      p
      for p in live
      if told.get(self.process_of[p], (None,))[0] != self._incarnations[self.process_of[p]]
    ]
    failed = {i: their["error"] for i, (_, their) in told.items() if their["error"]}
    if gone:
      raise self._lost(gone, told, failed)
    if failed:
      detail = "; ".join(f"process {i}: {error}" for i, error in failed.items())
      raise RuntimeError(f"{what} failed while every process is live ({detail})")
    return told

  def _lost(self, pods: list[int], told: dict, failed: dict) -> IslandLost:
    seen = next(iter(failed.values()), "")
    # Should one that left run again (SIGCONT), it ends (pwtrain/liveness.py); told before the
    # launcher may start another in its place (leave_out), whose beat clears the verdict.
    for i in {self.process_of[p] for p in pods} - set(told) - {0}:
      liveness.declare_lost(i, f"process {i} left the run (no heartbeat)")
    # From now on the run's barriers wait for the survivors only.
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
    }
    if jax.process_index() == 0:
      for i in new:
        processes.tell(_handover(i), handover)
    # From the meeting's barrier on, the new processes are waited for: one that dies now is not
    # started again until the others have left it out anew.
    processes.tell_launcher(set(processes.live()) | set(new))
    self._meet(new)
    for i in new:
      self.controller.forget(i)

  def join(self, timeout_s: float = 600.0) -> dict:
    """A process started in a dead one's place (processes.rejoining), once it has compiled its
    programs: starts its transfer server (its address replaces its predecessor's), says it is
    ready, waits for the live processes' handover (`welcome`), takes on their counts (program
    numbers, `processes.next_key`'s, Orbax's) and meets them. Returns the handover."""
    me = jax.process_index()
    # Its islands' collectives (islands of several devices) make their Gloo contexts again.
    processes.forget_collectives(d.id for d in jax.local_devices())
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

  def kill(self, pod: int, drill: str) -> None:
    """The drill `drill` ("kill:pod<pod>@..."): that pod's process SIGKILLs itself; elsewhere
    nothing happens (the others find it gone)."""
    if jax.process_index() != self.process_of[pod]:
      return
    log.warning("fault.inject %s: this process SIGKILLs itself", drill)
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
    return _first_line(e)
  return ""


def _first_line(error: Exception) -> str:
  """An error's first line, as the processes tell it to each other: a failed pull's error
  without the prefix every computation downstream of it repeats."""
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return _REPEATED.sub("", text)[:300]
