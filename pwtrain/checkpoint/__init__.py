"""Checkpoints: the whole-model train state and the data position, saved with Orbax.

checkpointer   `Checkpointer`: asynchronous atomic saves, restore onto any layout, damaged
               checkpoints set aside (the one the trainer, sampling and the tests use)
integrity      array paths, fingerprints, compatibility, damage and (distributed) agreement
parts          a state saved in parts, one per island: the format, and the `PartWriter`
               protocol of who writes them (remote workers, or a distributed run's processes)
process_parts  distributed mode's part writer and its reads on the host
managers       Orbax's manager of the directory: every process's, or one writer's alone
"""

from pwtrain.checkpoint.checkpointer import Checkpointer
from pwtrain.checkpoint.integrity import CorruptCheckpoint, IncompatibleCheckpoint
from pwtrain.checkpoint.parts import PartWriter, PendingParts
from pwtrain.checkpoint.process_parts import ProcessParts

__all__ = [
  "Checkpointer",
  "CorruptCheckpoint",
  "IncompatibleCheckpoint",
  "PartWriter",
  "PendingParts",
  "ProcessParts",
]
