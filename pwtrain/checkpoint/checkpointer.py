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
import numpy as np
import orbax.checkpoint as ocp
from absl import flags

from pwtrain import processes
from pwtrain.checkpoint import managers, process_parts, quiet, saving
from pwtrain.checkpoint import parts as checkpoint_parts
from pwtrain.checkpoint.integrity import (
  CorruptCheckpoint,
  IncompatibleCheckpoint,
  agree,
  check_compatible,
  fingerprint,
  is_damage,
  one_line,
  path_name,
  saved_leaves,
)
from pwtrain.checkpoint.parts import PartWriter

log = logging.getLogger(__name__)

# Leaves this process holds; anything else is a reference to an island worker's array.
_LOCAL = (jax.Array, np.ndarray, np.generic, int, float)


class Checkpointer:
  """Saves and restores the whole-model train state with its data-iterator position.

  `part_writer` (a `parts.PartWriter`) writes a state in parts, one per island, which the
  Checkpointer then commits as one step: a state of references to arrays held elsewhere (remote
  island workers) always, and this process's arrays when the writer says it writes those
  (distributed mode's processes). Without one, states this process holds are saved whole.

  In distributed mode a save spans every process of the run, unless one `writer` saves alone
  (elastic pods: pod 0's process holds the whole model and every data stream's position, and
  no save waits for another process); the others then save nothing (managers.py).
  """

  def __init__(
    self,
    directory: str,
    *,
    keep: int,
    every: int,
    async_save: bool = True,
    part_writer: PartWriter | None = None,
    read_only: bool = False,
    discard_if=None,
    writer: int | None = None,
  ):
    """`read_only`: a reader beside a possibly running job (sampling): it neither removes
    uncommitted parts nor moves damaged checkpoints aside (it skips them), and cannot save.
    `discard_if(error)`: whether a save that failed with `error` is only discarded (one line;
    elastic pods: a worker holding its arrays was lost) rather than raised. `writer`: the one
    process that saves (distributed mode, elastic pods: 0), its state's arrays all its own;
    `save` elsewhere does nothing."""
    if jax.process_count() > 1:
      # Orbax's default barrier between processes is a collective over every device, which
      # would run beside the islands' own computations and deadlock on CPU; this flag makes it
      # a barrier of JAX's coordination service.
      flags.FLAGS["experimental_orbax_use_distributed_barrier"].value = True
    self.directory = os.path.abspath(directory)
    self.every = every
    self.read_only = read_only
    if part_writer is not None and not isinstance(part_writer, PartWriter):
      raise TypeError(f"part_writer {part_writer!r} is not a checkpoint.parts.PartWriter")
    self._part_writer = part_writer
    self._keep, self._async_save = keep, async_save
    self._manager: ocp.CheckpointManager | None = None
    self._writer = writer
    if writer is None or not processes.rejoining():  # Orbax's opening barrier: every process
      self._opened()
    # Parts of remote saves that were never committed (a crash between the phases) are garbage.
    self.pending_root = f"{self.directory}.pending"
    if os.path.isdir(self.pending_root) and not read_only and jax.process_index() == 0:
      log.warning("removing uncommitted checkpoint parts in %s", self.pending_root)
      shutil.rmtree(self.pending_root)
    self._discard_if = discard_if or (lambda error: False)
    self._in_flight: saving.InFlight | None = None  # a save not yet seen finished
    quiet.install()

  def _opened(self) -> ocp.CheckpointManager:
    """Orbax's manager of this directory (managers.py), opened on first use."""
    if self._manager is None:
      self._manager = managers.open_manager(
        self.directory,
        keep=self._keep,
        async_save=self._async_save,
        read_only=self.read_only,
        writer=self._writer,
      )
    return self._manager

  @property
  def _saves_here(self) -> bool:
    return self._writer is None or self._writer == jax.process_index()

  def latest_step(self) -> int | None:
    if not self._saves_here:  # what the writer committed since
      self._opened().reload()
    return self._opened().latest_step()

  def all_steps(self) -> list[int]:
    if not self._saves_here:
      self._opened().reload()
    return sorted(self._opened().all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step % self.every == 0 or step == last_step

  def save(self, step: int, state, data_state: dict) -> None:
    """Saves asynchronously (`async_save=False`: written when it returns). A state of
    references (leaves held by island workers) is written by the workers through `part_writer`
    and committed in two phases. A failure of a save in flight is raised here, by `check_saves`
    or by `wait`; one of the storage (a full disk) as `saving.SaveFailed`, in one line."""
    if self.read_only:
      raise RuntimeError(f"{self.directory} was opened read-only: no saves")
    if not self._saves_here:  # another process saves alone
      return
    refs = not all(isinstance(x, _LOCAL) for x in jax.tree.leaves(state))  # workers' arrays
    if refs or (self._part_writer is not None and self._part_writer.local_arrays):
      self._save_parts(step, state, data_state)
      return
    self._finish_save(block=True)  # one save at a time; the previous one's failure raised
    fingerprints = fingerprint(state, here=self._writer is not None)
    if self._writer is not None:  # its arrays on the host, written by this process alone
      state = jax.tree.map(np.asarray, state)
    self._in_flight = saving.InFlight(self._opened(), self.directory, step)
    try:
      self._opened().save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_state),
          integrity=ocp.args.JsonSave({"fingerprint": fingerprints}),
        ),
      )
    except Exception as e:  # a synchronous save's failure (an asynchronous one's: later)
      in_flight, self._in_flight = self._in_flight, None
      in_flight.failed(e)
    if not self._async_save:
      self._finish_save(block=True)

  def check_saves(self) -> None:
    """Raises `saving.SaveFailed` (one line) at once if a save in flight has failed for want of
    storage (a full disk, a quota, a file size limit), and any other failure of it as it is;
    never waits. The trainer calls it after every step, so that a run whose save failed stops
    at the first step after the failure, not at its next save."""
    self._finish_save(block=False)

  def _finish_save(self, *, block: bool) -> None:
    """Once the save in flight is written (`block`: waits for it): its failure raised."""
    in_flight = self._in_flight
    if in_flight is not None and (block or not in_flight.running()):
      self._in_flight = None
      in_flight.finish()

  def _save_parts(self, step, state, data_state) -> None:
    if self._part_writer is None:
      raise TypeError("this state's leaves are references held elsewhere: pass a part_writer")
    self._finish_save(block=True)  # one save at a time, as the manager does
    manager = self._opened()  # opened here, in the trainer's thread, not in the commit's
    # Distributed mode: every process writes into the same pending directory (saves come in
    # the same order on every process); remote: a fresh name per save.
    shared = self._part_writer.local_arrays
    suffix = processes.next_key("save").split("/")[1] if shared else uuid.uuid4().hex[:8]
    pending = os.path.join(self.pending_root, f"{step}-{suffix}")
    os.makedirs(pending, exist_ok=shared)
    try:
      save = self._part_writer(state, pending)  # phase one starts on every worker
    except Exception as e:
      shutil.rmtree(pending, ignore_errors=True)
      if not self._discarded(step, e):
        raise
      return

    def commit():
      try:
        fingerprints = save.wait()
        # Phase two: every part is written; the step appears (atomically) only now.
        manager.save(
          step,
          args=ocp.args.Composite(
            parts=checkpoint_parts.PartsSave(save.parts),
            data=ocp.args.JsonSave(data_state),
            integrity=ocp.args.JsonSave({"fingerprint": fingerprints}),
          ),
        )
        manager.wait_until_finished()  # this thread's end is the save's (check_saves)
      except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread (InFlight)
        if self._discarded(step, e):
          return
        if saving.storage_reason(e) is None:  # a storage failure: one line (InFlight)
          log.error("checkpoint %d not committed: %s", step, e)
        in_flight.error = e
      finally:
        if not shared or jax.process_index() == 0:  # distributed: after process 0 moved all
          shutil.rmtree(pending, ignore_errors=True)  # parts not moved into a committed step

    in_flight = saving.InFlight(manager, self.directory, step)
    in_flight.commit = threading.Thread(target=commit, name=f"commit-{step}", daemon=True)
    self._in_flight = in_flight
    in_flight.commit.start()
    if not self._async_save:  # train.async_checkpoint=False: committed before the step goes on
      self._finish_save(block=True)

  def _discarded(self, step: int, error: BaseException) -> bool:
    """Whether the failed save of `step` is only discarded (`discard_if`), said in one line."""
    if not self._discard_if(error):
      return False
    log.warning("checkpoint %d discarded: %s", step, error)
    return True

  def restore(self, step: int, abstract_state):
    """Restores (state, data_state) of `step` into the shardings carried by `abstract_state`.

    Raises IncompatibleCheckpoint if the saved arrays do not match `abstract_state`, and
    CorruptCheckpoint if they cannot be read or fail their fingerprint. An error that says
    nothing about the files (`integrity.is_damage`: a TypeError and the like from reading
    code, ours or a library's, or a device error) is raised as it is: taking it for damage
    would set a good checkpoint aside. In distributed mode each process reads what its islands
    hold, so the processes agree before any of them raises (`integrity.agree`): when one finds
    the checkpoint damaged, every one raises CorruptCheckpoint (all set it aside together), and
    none waits for another in Orbax's barrier of the read or in the fingerprint exchange.
    """
    failure = None
    try:
      in_parts = self._check(step, abstract_state)
    except Exception as e:  # noqa: BLE001 - every process hears of it first (agree)
      failure = e
    agree(step, failure)  # before the read, whose Orbax barrier every process must reach
    try:
      state, restored = self._read(step, abstract_state, in_parts)
    except Exception as e:  # noqa: BLE001 - as above
      failure = e
    agree(step, failure)
    if "integrity" in restored:
      expected = restored["integrity"]["fingerprint"]
      actual = fingerprint(state)  # the same on every process: each island's processes tell
      bad = sorted(k for k in expected if actual.get(k) != expected[k])
      if bad or set(actual) != set(expected):
        raise CorruptCheckpoint(f"step {step}: fingerprint mismatch in {bad[:5] or 'its keys'}")
    return state, restored["data"]

  def _check(self, step: int, abstract_state) -> bool:
    """Whether `step` is saved in parts, once its metadata matches `abstract_state`."""
    in_parts = os.path.isdir(self._parts(step))
    try:
      if in_parts:
        saved = checkpoint_parts.PartsHandler().metadata(self._parts(step))
      else:
        saved = saved_leaves(self._opened().item_metadata(step)["state"])
    except Exception as e:  # unreadable metadata: a damaged checkpoint, not another model
      if not is_damage(e):
        raise
      raise CorruptCheckpoint(f"step {step}: metadata unreadable: {one_line(e)}") from e
    try:
      check_compatible(saved, abstract_state)
    except IncompatibleCheckpoint as e:
      raise IncompatibleCheckpoint(f"step {step}: {e}") from None
    return in_parts

  def _read(self, step: int, abstract_state, in_parts: bool):
    """(state, {"data": ..., "integrity": ... if saved}) as read from `step`'s files."""
    parts_dir = self._parts(step)
    has_integrity = os.path.isdir(os.path.join(self.directory, str(step), "integrity"))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    abstract = {path_name(path): a for path, a in flat}
    on_host = jax.process_count() > 1  # distributed mode reads on the host (process_parts)
    if on_host:
      items = {}
    elif in_parts:
      items = {"parts": checkpoint_parts.PartsRestore(abstract)}
    else:
      items = {"state": ocp.args.StandardRestore(abstract_state)}
    items["data"] = ocp.args.JsonRestore()
    if has_integrity:
      items["integrity"] = ocp.args.JsonRestore()
    with quiet.quiet_if_failed():
      failure = None
      try:
        restored = self._opened().restore(step, args=ocp.args.Composite(**items))
        if on_host:
          values = {}
          for part in checkpoint_parts.part_dirs(parts_dir) if in_parts else [self._item(step)]:
            values.update(process_parts.read_on_host(part, abstract))
      except Exception as e:  # dropped here, so the reads it abandoned die inside the guard
        if not is_damage(e):
          raise
        failure = CorruptCheckpoint(f"step {step}: {type(e).__name__}: {one_line(e)}")
      if failure is not None:
        raise failure
    if on_host:
      state = jax.tree.unflatten(treedef, [values[n] for n in abstract])
    elif in_parts:
      state = jax.tree.unflatten(treedef, [restored.parts[n] for n in abstract])
    else:
      state = restored.state
    return state, {k: restored[k] for k in ("data", "integrity") if k in items}

  def _item(self, step: int) -> str:
    return os.path.join(self.directory, str(step), "state")

  def _parts(self, step: int) -> str:
    return os.path.join(self.directory, str(step), "parts")

  def restore_latest(self, abstract_state):
    """(step, state, data_state) of the newest readable checkpoint, or None if there is none.

    Damaged checkpoints are reported and moved aside, newest first, until one restores.
    """
    with quiet.abandoned_reads_dropped():
      return self._restore_latest(abstract_state)

  def _restore_latest(self, abstract_state):
    for step in reversed(self.all_steps()):
      try:
        state, data = self.restore(step, abstract_state)
      except CorruptCheckpoint as e:
        if self.read_only:
          log.error("checkpoint %s is damaged (%s); skipped", step, e)
          continue
        moved = self.quarantine(step)
        log.error("checkpoint %s is damaged (%s); moved to %s", step, e, moved)
        continue
      return step, state, data
    return None

  def quarantine(self, step: int, reason: str = "corrupt") -> str:
    """Moves a step to `<directory>.<reason>/`, out of the manager's sight but kept. In
    distributed mode process 0 moves it; the others wait for that (a barrier)."""
    if jax.process_count() > 1:
      processes.barrier(f"quarantine/{step}/{processes.next_key('quarantine')}")
      if jax.process_index() != 0:
        processes.barrier(f"quarantined/{step}/{processes.next_key('quarantined')}")
        self._opened().reload()
        return f"{self.directory}.{reason}/{step}"
    target_root = f"{self.directory}.{reason}"
    os.makedirs(target_root, exist_ok=True)
    target = os.path.join(target_root, str(step))
    n = 1
    while os.path.exists(target):
      target, n = os.path.join(target_root, f"{step}.{n}"), n + 1
    shutil.move(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      processes.barrier(f"quarantined/{step}/{processes.next_key('quarantined')}")
    self._opened().reload()
    return target

  def delete(self, step: int) -> None:
    self._opened().delete(step)

  def wait(self) -> None:
    """Waits for the save in flight; its failure raised (a storage failure as
    `saving.SaveFailed`, one line)."""
    try:
      self._finish_save(block=True)
    finally:
      if self._manager is not None:
        self._manager.wait_until_finished()

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
