"""What a checkpoint must match: array paths and fingerprints, independent of any mesh.

`path_name` names an array by its path in the train state (`params/blocks/0/attn/wq`), the
same for every layout and for the parts island workers write. `fingerprint` is a per-array
position-weighted sum of its bits (mod 2**32): exact and associative, so it does not depend on
how the array is sharded, and a flipped, swapped or zeroed element changes it. `check_compatible`
tells a checkpoint of another model (an error) from a damaged one (`CorruptCheckpoint`, which
restore falls back past); `is_damage` tells a damaged one from an error of reading code, and
`agree` makes the processes of a distributed run take the same view of a checkpoint.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from pwtrain import processes


class IncompatibleCheckpoint(ValueError):
  """The checkpoint's arrays do not have this config's structure, shapes or dtypes."""


class CorruptCheckpoint(RuntimeError):
  """A checkpoint that cannot be read, or reads back different from what was saved."""


def check_compatible(saved: dict, abstract_state) -> None:
  """`saved`: {array path: (shape, dtype name)} of a checkpoint."""
  wanted = saved_leaves(abstract_state)
  if set(saved) != set(wanted):
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    raise IncompatibleCheckpoint(f"arrays differ: missing {missing[:5]}, unexpected {extra[:5]}")
  for key, (shape, dtype) in wanted.items():
    if saved[key] != (shape, dtype):
      raise IncompatibleCheckpoint(
        f"{key}: saved shape/dtype {saved[key]}, this config needs {(shape, dtype)}"
      )


def saved_leaves(tree) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(path): (tuple(leaf.shape), jnp.dtype(leaf.dtype).name) for path, leaf in flat}


def path_name(path) -> str:
  """A path as names joined by "/", e.g. opt_state/0/v/blocks/0/attn/wq. Saved metadata keeps
  lists and optimizer-state tuples as dicts with string keys, so only the names are compared."""
  names = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
    else:
      names.append(str(key))
  return "/".join(names)


@jax.jit
def _fingerprints(leaves):
  # A position-weighted sum of each array's bits, modulo 2**32. Integer addition is exact and
  # associative, so the result does not depend on how the array is sharded (a checkpoint may be
  # restored onto another mesh), and a changed, swapped or zeroed element changes it.
  out = []
  for x in leaves:
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    bits = bits.astype(jnp.uint32).reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    out.append(jnp.sum(bits * weights, dtype=jnp.uint32))
  return out


def fingerprint(state, here: bool = False) -> dict:
  """{array path: 32-bit fingerprint} of a state pytree (fetched to the host).

  Arrays on different islands (a pipelined state) are fingerprinted island by island, since one
  computation cannot take inputs from two device sets. In distributed mode each island's
  processes tell the others theirs, unless `here`: this process holds every array (a sole
  writer's save), and no other is asked or told.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  groups: dict = {}
  for path, leaf in flat:
    if not isinstance(leaf, jax.Array):
      leaf = jnp.asarray(leaf)
    groups.setdefault(frozenset(leaf.sharding.device_set), []).append((path, leaf))
  result = {}
  key = None if here else processes.next_key("fingerprint")
  me = jax.process_index()
  for n, (devices, members) in enumerate(groups.items()):
    leaves = [leaf for _, leaf in members]
    if any(d.process_index == me for d in devices):
      leaves = _fingerprints(leaves)  # else only other processes hold them: to_host asks
    values = jax.device_get(leaves) if here else processes.to_host(leaves, f"{key}/{n}")
    for (path, _), v in zip(members, values, strict=True):
      result[path_name(path)] = int(np.asarray(v))
  return result


# What reading damaged files raises; anything else (a KeyError, an IndexError, a plain
# ValueError or RuntimeError, a device's error) is a bug in reading code, ours or a library's,
# or a device's failure, and must not set a good checkpoint aside (a bug of ours once did, and
# training began again from step 0). Orbax wraps a failed array read in a plain Exception
# raised from TensorStore's error, a ValueError whose message starts with its status code.
_DAMAGE = (CorruptCheckpoint, OSError, json.JSONDecodeError)
_TENSORSTORE_STATUS = re.compile(
  r"^(DATA_LOSS|FAILED_PRECONDITION|NOT_FOUND|OUT_OF_RANGE|INVALID_ARGUMENT|UNKNOWN): "
)


def is_damage(error: BaseException) -> bool:
  """Whether an error raised while reading a checkpoint says that its files are damaged: it,
  or an error it was raised from, is one that damaged files raise (an OS error, a JSON decode
  error, a TensorStore read error, a failed fingerprint)."""
  while error is not None:
    if isinstance(error, _DAMAGE):
      return True
    if type(error) is ValueError and _TENSORSTORE_STATUS.match(str(error)):
      return True
    error = error.__cause__
  return False


_SEVERITY = {CorruptCheckpoint: 1, IncompatibleCheckpoint: 2}  # anything else: 3


def agree(step: int, failure: Exception | None) -> None:
  """Raises on every process when reading `step` failed on any (a no-op outside distributed
  mode when it did not fail here). The worst failure wins (damaged < another model's < an
  error): a process that failed that way raises its own exception, the others one naming the
  process, of the same kind, so that all set the checkpoint aside or all stop."""
  mine = None
  if failure is not None:
    mine = {"severity": _SEVERITY.get(type(failure), 3), "message": one_line(failure)}
  said = processes.gather(processes.next_key(f"restore/{step}"), mine)
  told = zip(processes.live(), said, strict=True)
  failed = [(s["severity"], p, s["message"]) for p, s in told if s is not None]
  if not failed:
    return
  severity, process, message = max(failed, key=lambda f: (f[0], -f[1]))
  if mine is not None and mine["severity"] == severity:
    raise failure
  if severity == 1:
    raise CorruptCheckpoint(f"step {step}: process {process} could not read it: {message}")
  if severity == 2:
    raise IncompatibleCheckpoint(f"step {step}: on process {process}: {message}")
  raise RuntimeError(f"checkpoint {step}: process {process} failed reading it: {message}")


def one_line(error: BaseException, limit: int = 200) -> str:
  """An error's first line, shortened: library errors (TensorStore's) run to pages."""
  lines = str(error).strip().splitlines() or [""]
  first = lines[0] if len(lines[0]) <= limit else lines[0][:limit] + "..."
  return first + (" ..." if len(lines) > 1 else "")
