"""Orbax checkpoints: the train state (sharded) and the data iterator's position.

Saves are asynchronous (the step loop goes on while arrays are written) and atomic (Orbax writes
to a temporary directory and renames it on commit, so a crash mid-save leaves the previous
checkpoint as the latest). Restore reads straight into the target shardings, so a checkpoint can
be restored onto a different mesh than it was saved from.
"""

import os

import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, *, keep: int, every: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.every = every
    self._manager = ocp.CheckpointManager(
      self.directory,
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
    return list(self._manager.all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step % self.every == 0 or step == last_step

  def save(self, step: int, state, data_state: dict) -> None:
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
      ),
    )

  def restore(self, step: int, abstract_state):
    """Restores (state, data_state) of `step` into the shardings carried by `abstract_state`."""
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
      ),
    )
    return restored.state, restored.data

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
