"""TensorBoard's events file of one start of a run, written on the thread that adds the events.

tensorboardX's `SummaryWriter` writes from a thread of its own: a write that fails there (a
full disk) ends that thread with a traceback, and the run then blocks for good on the next
event once the writer's queue (10 events) is full. `Events` writes each event where it is
added, so a write the storage refuses is an OSError of the caller's, which metrics.py turns into
one line (`errors.WriteFailed`). The file is TensorBoard's own format: TFRecord-framed `Event`
protos, as tensorboardX writes them (its `RecordWriter` and protos).

tensorboardX's package imports torch where it is installed (its `SummaryWriter` accepts torch
tensors), a second and more of every start. Unless torch is loaded already, it is imported here
as if torch were absent (a None in `sys.modules` makes `import torch` fail, as tensorboardX
allows): none of what is used here touches torch.
"""

import itertools
import os
import socket
import sys
import time

_TORCH_LOADED = "torch" in sys.modules
if not _TORCH_LOADED:
  sys.modules["torch"] = None  # tensorboardX's `import torch` fails: torch's absence
try:
  from tensorboardX.proto.event_pb2 import Event, SessionLog
  from tensorboardX.record_writer import RecordWriter
  from tensorboardX.summary import scalar
finally:
  if not _TORCH_LOADED:
    del sys.modules["torch"]  # a later `import torch` (by anyone) imports it as usual

_OPENED = itertools.count()  # two files opened in one second (a rollback's) get two names


class Events:
  def __init__(self, logdir: str, purge_step: int):
    """A new events file in `logdir` (created if absent) that starts by purging the events of
    steps from `purge_step` on in the files before it (TensorBoard drops them: they belong to
    steps that run again)."""
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self.path = os.path.join(logdir, f"{name}.{os.getpid()}.{next(_OPENED)}")
    self._file = RecordWriter(self.path)
    now = time.time()
    self._add(Event(wall_time=now, step=purge_step, file_version="brain.Event:2"))
    start = SessionLog(status=SessionLog.START)
    self._add(Event(wall_time=now, step=purge_step, session_log=start))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._add(Event(wall_time=time.time(), step=step, summary=scalar(tag, value)))

  def _add(self, event: Event) -> None:
    self._file.write(event.SerializeToString())

  def flush(self) -> None:
    """Writes what is buffered and syncs it to the disk."""
    self._file.flush()

  def close(self) -> None:
    self.flush()
    self._file.close()
