"""Orbax checkpoints: the train state (sharded) and the data iterator's position.

Saves are asynchronous (the step loop goes on while arrays are written) and atomic (Orbax writes
to a temporary directory and renames it on commit, so a crash mid-save leaves the previous
checkpoint as the latest). Restore reads straight into the target shardings, so a checkpoint can
be restored onto a different mesh than it was saved from.

Orbax does not checksum array data: a flipped byte in a chunk restores silently as a wrong
value. Each checkpoint therefore also holds an "integrity" item, a fingerprint of every array
computed on device before the save, and `restore_latest` recomputes it after reading. A
checkpoint that cannot be read or whose fingerprint differs is reported, moved aside to
`<directory>.corrupt/<step>` (never deleted) and the one before it is used; a checkpoint written
for another model (its saved shapes differ from this config's) is an error instead, because
falling back past it would silently train something else.
"""

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class IncompatibleCheckpoint(ValueError):
  """The checkpoint's arrays do not have this config's structure, shapes or dtypes."""


class Checkpointer:
  def __init__(self, directory: str, *, keep: int, every: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.every = every
    self._manager = ocp.CheckpointManager(
      self.directory,
      # Named handlers let a fresh manager read metadata before anything was saved in it.
      item_handlers={
        "state": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "integrity": ocp.JsonCheckpointHandler(),
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=1,  # the trainer decides when; see should_save
        enable_async_checkpointing=async_save,
        create=True,
      ),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step % self.every == 0 or step == last_step

  def save(self, step: int, state, data_state: dict) -> None:
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        integrity=ocp.args.JsonSave({"fingerprint": fingerprint(state)}),
      ),
    )

  def restore(self, step: int, abstract_state):
    """Restores (state, data_state) of `step` into the shardings carried by `abstract_state`.

    Raises IncompatibleCheckpoint if the saved arrays do not match `abstract_state`, and
    CorruptCheckpoint if they cannot be read or fail their fingerprint.
    """
    try:
      saved = self._manager.item_metadata(step)["state"]
    except Exception as e:  # unreadable metadata: a damaged checkpoint, not another model
      raise CorruptCheckpoint(f"step {step}: metadata unreadable: {e}") from e
    try:
      check_compatible(saved, abstract_state)
    except IncompatibleCheckpoint as e:
      raise IncompatibleCheckpoint(f"step {step}: {e}") from None
    has_integrity = os.path.isdir(os.path.join(self.directory, str(step), "integrity"))
    items = {
      "state": ocp.args.StandardRestore(abstract_state),
      "data": ocp.args.JsonRestore(),
    }
    if has_integrity:
      items["integrity"] = ocp.args.JsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      raise CorruptCheckpoint(f"step {step}: {type(e).__name__}: {str(e)[:500]}") from e
    if has_integrity:
      expected = restored.integrity["fingerprint"]
      actual = fingerprint(restored.state)
      bad = sorted(k for k in expected if actual.get(k) != expected[k])
      if bad or set(actual) != set(expected):
        raise CorruptCheckpoint(f"step {step}: fingerprint mismatch in {bad[:5] or 'its keys'}")
    return restored.state, restored.data

  def restore_latest(self, abstract_state):
    """(step, state, data_state) of the newest readable checkpoint, or None if there is none.

    Damaged checkpoints are reported and moved aside, newest first, until one restores.
    """
    for step in reversed(self.all_steps()):
      try:
        state, data = self.restore(step, abstract_state)
      except CorruptCheckpoint as e:
        moved = self.quarantine(step)
        logging.error("checkpoint %s is damaged (%s); moved to %s", step, e, moved)
        continue
      return step, state, data
    return None

  def quarantine(self, step: int, reason: str = "corrupt") -> str:
    """Moves a step to `<directory>.<reason>/`, out of the manager's sight but kept."""
    target_root = f"{self.directory}.{reason}"
    os.makedirs(target_root, exist_ok=True)
    target = os.path.join(target_root, str(step))
    n = 1
    while os.path.exists(target):
      target, n = os.path.join(target_root, f"{step}.{n}"), n + 1
    shutil.move(os.path.join(self.directory, str(step)), target)
    self._manager.reload()
    return target

  def delete(self, step: int) -> None:
    self._manager.delete(step)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


class CorruptCheckpoint(RuntimeError):
  """A checkpoint that cannot be read, or reads back different from what was saved."""


def check_compatible(saved_metadata, abstract_state) -> None:
  saved = _leaves(saved_metadata)
  wanted = _leaves(abstract_state)
  if set(saved) != set(wanted):
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    raise IncompatibleCheckpoint(f"arrays differ: missing {missing[:5]}, unexpected {extra[:5]}")
  for key, (shape, dtype) in wanted.items():
    if saved[key] != (shape, dtype):
      raise IncompatibleCheckpoint(
        f"{key}: saved shape/dtype {saved[key]}, this config needs {(shape, dtype)}"
      )


def _leaves(tree) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_path(path): (tuple(leaf.shape), jnp.dtype(leaf.dtype).name) for path, leaf in flat}


def _path(path) -> str:
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


def fingerprint(state) -> dict:
  """{array path: 32-bit fingerprint} of a state pytree (fetched to the host).

  Arrays on different islands (a pipelined state) are fingerprinted island by island, since one
  computation cannot take inputs from two device sets.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  groups: dict = {}
  for path, leaf in flat:
    if not isinstance(leaf, jax.Array):
      leaf = jnp.asarray(leaf)
    groups.setdefault(frozenset(leaf.sharding.device_set), []).append((path, leaf))
  result = {}
  for members in groups.values():
    values = jax.device_get(_fingerprints([leaf for _, leaf in members]))
    for (path, _), v in zip(members, values, strict=True):
      result[_path(path)] = int(np.asarray(v))
  return result
