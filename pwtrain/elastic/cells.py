"""Moving the live pods' train state onto another pod set (elastic pods, steps.py): a pod in
both sets keeps its cells' state where it is, a returning pod is given a copy of a live pod's
cells, and where the two sets' cells are not laid out alike the state goes through its
whole-model form.
"""

import dataclasses
from typing import Any

import jax

from pwtrain.backend.run_mode import results
from pwtrain.parallel.pipeline.state import state_key
from pwtrain.sharding import stand_in


@dataclasses.dataclass(frozen=True)
class Copy:
  """Cell `cell`'s state (its value elsewhere) to be copied onto its island, laid out as
  `shardings`."""

  cell: tuple  # (pod, stage) of the new program
  value: Any
  shardings: Any


def keep_cells(old, new, state: dict, sources: dict, same: dict) -> dict | None:
  """`new`'s pipeline state with the cells of its pod i (each pod with state in `new`) taken
  from `old`'s pod `sources[i]` (pod numbers as each program numbers them): as they are where
  `same[i]` (the same pod on the same islands), else a `Copy` for pod i's islands; or None
  where the two programs' cells are not laid out alike."""
  if not (hasattr(old, "cell_shardings") and hasattr(new, "cell_shardings")):
    return None
  out = {}
  for (i, s), shardings in new.cell_shardings.items():
    source = (sources[i], s)
    if jax.tree.structure(shardings) != jax.tree.structure(old.cell_shardings.get(source)):
      return None
    value = state[state_key(source)]
    out[state_key((i, s))] = value if same[i] else Copy((i, s), value, shardings)
  return out


def pod_of_key(key: str) -> int:
  """The pod of a pipeline state key "state/<pod>.<stage>" (pipeline/state.py)."""
  return int(key.removeprefix("state/").split(".")[0])


def for_pods(whole: dict, program, num_pods: int) -> dict:
  """A whole-model state shaped for `program`'s restore target: every pod's where the pods'
  states differ (a dropped pod's gone, a rejoining pod's a copy of the first), else one; the
  exchange's own entries (DiLoCo's anchor, stale gradients) as the program's exchange has them
  (made afresh from the parameters where the state had none)."""
  target = program.abstract_state
  per_pod = "pods" in target
  pods = whole["pods"] if "pods" in whole else [whole]
  if per_pod:
    pods = (pods + [pods[0]] * num_pods)[:num_pods]
  one = target["pods"][0] if per_pod else target
  exchange = getattr(program, "exchange", None)
  fitted = []
  for pod in pods:
    missing = [k for k in one if k not in pod]
    fresh = exchange.init_state(pod["params"]) if missing else {}
    fitted.append({k: pod[k] if k in pod else fresh[k] for k in one})
  return {"pods": fitted} if per_pod else fitted[0]


def stand_ins(program) -> dict:
  """`program`'s state as a process holds it where none of it is on its devices (distributed
  mode: a process started in a dead one's place, before its pod's state is copied to it):
  every cell's, as its init makes it, with no data."""
  return {
    state_key(c): jax.tree.map(stand_in, program.executables[("init", *c)].compiled.out_info)
    for c in program.cell_shardings
  }


def hand_over(controller, plan, copy: Copy):
  """`copy` made by one pull from the process that holds its value to the process of its
  cell's island in `plan` (distributed mode; every process calls it alike, stand-ins
  elsewhere)."""
  value = results({"value": copy.value})["value"]
  (source,) = {d.process_index for x in jax.tree.leaves(value) for d in x.sharding.device_set}
  (destination,) = plan.cells[copy.cell].processes
  spec = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), value, copy.shardings
  )
  return controller.hand_over(value, source, destination, spec)
