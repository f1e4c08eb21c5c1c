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
import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pwtrain import checkpoint_parts

# Leaves this process holds; anything else is a reference to an island worker's array.
_LOCAL = (jax.Array, np.ndarray, np.generic, int, float)


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
        "parts": checkpoint_parts.PartsHandler(),  # a remote state, written by its workers
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=1,  # the trainer decides when; see should_save
        enable_async_checkpointing=async_save,
        create=True,
      ),
    )
    # Parts of remote saves that were never committed (a crash between the phases) are garbage.
    self.pending_root = f"{self.directory}.pending"
    if os.path.isdir(self.pending_root):
      logging.warning("removing uncommitted checkpoint parts in %s", self.pending_root)
      shutil.rmtree(self.pending_root)
    self._commit: threading.Thread | None = None
    self._commit_error: BaseException | None = None

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step % self.every == 0 or step == last_step

  def save(self, step: int, state, data_state: dict) -> None:
    """Saves asynchronously. A remote state (leaves on island workers, backend.remote.saves) is
    written by the workers and committed in two phases; a failure of a previous save is raised
    here or by `wait`."""
    if not all(isinstance(x, _LOCAL) for x in jax.tree.leaves(state)):  # worker references
      self._save_parts(step, state, data_state)
      return
    self._join_commit()
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        integrity=ocp.args.JsonSave({"fingerprint": fingerprint(state)}),
      ),
    )

  def _save_parts(self, step, state, data_state) -> None:
    from pwtrain.backend.remote import saves  # grpc: only a remote state needs it

    self._join_commit()  # one save at a time, as the manager does
    pending = os.path.join(self.pending_root, f"{step}-{uuid.uuid4().hex[:8]}")
    os.makedirs(pending)
    save = saves.PendingSave(state, pending)  # phase one starts on every worker

    def commit():
      try:
        fingerprints = save.wait()
        # Phase two: every part is written; the step appears (atomically) only now.
        self._manager.save(
          step,
          args=ocp.args.Composite(
            parts=checkpoint_parts.PartsSave(save.parts),
            data=ocp.args.JsonSave(data_state),
            integrity=ocp.args.JsonSave({"fingerprint": fingerprints}),
          ),
        )
      except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread by _join_commit
        logging.error("checkpoint %d not committed: %s", step, e)
        self._commit_error = e
      finally:
        shutil.rmtree(pending, ignore_errors=True)  # parts not moved into a committed step

    self._commit = threading.Thread(target=commit, name=f"commit-{step}", daemon=True)
    self._commit.start()

  def _join_commit(self) -> None:
    if self._commit is not None:
      self._commit.join()
      self._commit = None
    error, self._commit_error = self._commit_error, None
    if error is not None:
      raise error

  def restore(self, step: int, abstract_state):
    """Restores (state, data_state) of `step` into the shardings carried by `abstract_state`.

    Raises IncompatibleCheckpoint if the saved arrays do not match `abstract_state`, and
    CorruptCheckpoint if they cannot be read or fail their fingerprint.
    """
    parts_dir = os.path.join(self.directory, str(step), "parts")
    in_parts = os.path.isdir(parts_dir)
    try:
      if in_parts:
        saved = checkpoint_parts.PartsHandler().metadata(parts_dir)
      else:
        saved = _leaves(self._manager.item_metadata(step)["state"])
    except Exception as e:  # unreadable metadata: a damaged checkpoint, not another model
      raise CorruptCheckpoint(f"step {step}: metadata unreadable: {e}") from e
    try:
      check_compatible(saved, abstract_state)
    except IncompatibleCheckpoint as e:
      raise IncompatibleCheckpoint(f"step {step}: {e}") from None
    has_integrity = os.path.isdir(os.path.join(self.directory, str(step), "integrity"))
    if in_parts:
      flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
      abstract = {path_name(path): a for path, a in flat}
      items = {"parts": checkpoint_parts.PartsRestore(abstract)}
    else:
      items = {"state": ocp.args.StandardRestore(abstract_state)}
    items["data"] = ocp.args.JsonRestore()
    if has_integrity:
      items["integrity"] = ocp.args.JsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      raise CorruptCheckpoint(f"step {step}: {type(e).__name__}: {str(e)[:500]}") from e
    if in_parts:
      state = jax.tree.unflatten(treedef, [restored.parts[n] for n in abstract])
    else:
      state = restored.state
    if has_integrity:
      expected = restored.integrity["fingerprint"]
      actual = fingerprint(state)
      bad = sorted(k for k in expected if actual.get(k) != expected[k])
      if bad or set(actual) != set(expected):
        raise CorruptCheckpoint(f"step {step}: fingerprint mismatch in {bad[:5] or 'its keys'}")
    return state, restored.data

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
    try:
      self._join_commit()
    finally:
      self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


class CorruptCheckpoint(RuntimeError):
  """A checkpoint that cannot be read, or reads back different from what was saved."""


def check_compatible(saved: dict, abstract_state) -> None:
  """`saved`: {array path: (shape, dtype name)} of a checkpoint."""
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
      result[path_name(path)] = int(np.asarray(v))
  return result
