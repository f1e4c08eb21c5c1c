"""Orbax's CheckpointManager of a checkpoint directory, for the processes that use it.

every process  one process, or every process of a distributed run together (Orbax's own
               multi-process saves and its barriers among them all)
one writer     elastic pods in distributed mode: pod 0's process holds the whole model's
               replica and every data stream's position, so it saves alone, with a manager of
               its own process (no barrier with any other: a process that dies during a save
               is waited for by nothing); every other process reads the directory with a
               read-only manager of its own, and saves nothing
a reader       beside a possibly running job (sampling, a finished run read back)
"""

import contextlib
import os

import jax
import orbax.checkpoint as ocp

from pwtrain.checkpoint import parts as checkpoint_parts
from pwtrain.checkpoint import quiet


def open_manager(
  directory: str, *, keep: int, async_save: bool, read_only: bool, writer: int | None
) -> ocp.CheckpointManager:
  """The manager of `directory` for this process: of every process (`writer` None), or of
  this process alone where one process `writer` saves for all (a read-only one elsewhere); a
  `read_only` reader keeps and saves nothing."""
  me = jax.process_index()
  alone = writer is not None
  reads_only = read_only or (alone and me != writer)
  if alone:  # Orbax creates a directory only with every process
    os.makedirs(directory, exist_ok=True)
  with quiet.read_only_notice_dropped() if reads_only else contextlib.nullcontext():
    return ocp.CheckpointManager(
      directory,
      # Named handlers let a fresh manager read metadata before anything was saved in it.
      item_handlers={
        "state": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "integrity": ocp.JsonCheckpointHandler(),
        "parts": checkpoint_parts.PartsHandler(),  # a state written in parts, by its islands
      },
      options=ocp.CheckpointManagerOptions(
        # A reader keeps and saves nothing (Orbax would say it set these itself).
        max_to_keep=None if reads_only else keep,
        save_interval_steps=0 if reads_only else 1,  # the trainer decides when: should_save
        enable_async_checkpointing=async_save,
        create=not (reads_only or alone),
        read_only=reads_only,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
          primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"pwtrain-p{me}"
        )
        if alone
        else ocp.options.MultiprocessingOptions(),
      ),
    )
