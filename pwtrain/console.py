"""What native libraries print to a process's stdout, kept to what a user needs to read.

Gloo (JAX's CPU collectives in a run of several processes) writes a notice to stdout from C++
each time a collective context connects, "[Gloo] Rank 0 is connected to 1 peer ranks. Expected
number of connected peer ranks is : 1", several per process and sometimes two on one line. No
setting of Gloo's or JAX's turns it off, and C++ writes to the file descriptor, past Python's
sys.stdout. So in a run whose console is the process's own (processes started by hand or by a
scheduler; `pwtrain.launch` filters its children's output itself), `drop_native_notices()`
puts a pipe in front of file descriptor 1: a thread copies every line to the console, except
those `NOTICE` matches, until the process exits (`flush()` first, where it leaves by
os._exit). With --verbosity set, nothing is filtered.
"""

import atexit
import os
import re
import sys
import threading

# Gloo's connection notices; the launcher drops the same lines from its console.
NOTICE = re.compile(r"\[Gloo\]|connected peer ranks")
# JAX's distributed runtime's warnings and errors (absl's format) as a failure spreads, and the
# gRPC detail lines under them: the launcher names the dead process itself, so they go to the
# processes' logs only (pwtrain/watch.py drops them from a watched process's console alike).
RUNTIME_FAILURE = re.compile(
  r"^[WEF]\d{4} [\d:.]+\s+\d+ (coordination_service\w*|client|distributed\w*|preemption\w*)"
  r"\.cc:\d+\]|^Additional GRPC error information|^:UNKNOWN:Error received from peer"
)
# The first line of a crash dump: an absl FATAL line (JAX ending a process whose peer died), a
# C++ terminate or check failure, a fatal signal's report, Python's fatal error and thread dump.
# The launcher keeps a process's lines from there on off its console (in its log only).
DUMP = re.compile(
  r"^F\d{4} \d\d:\d\d:\d\d|^terminate called|^\*\*\* (Check failure|SIG\w+ received)|"
  r"^Fatal Python error|Terminating process because the JAX distributed service"
)

_filter: dict = {}  # the running filter: its thread and the console's descriptor


def drop_native_notices() -> None:
  """From now on, lines matching NOTICE written to stdout (by Python or native code) are not
  shown; every other line is, in order. Idempotent."""
  if _filter:
    return
  sys.stdout.flush()
  console = os.dup(1)
  read, write = os.pipe()
  os.dup2(write, 1)
  os.close(write)

  def copy():
    with os.fdopen(read, "rb") as lines, os.fdopen(console, "wb", buffering=0) as out:
      for line in lines:
        if not NOTICE.search(line.decode(errors="replace")):
          out.write(line)

  thread = threading.Thread(target=copy, name="console", daemon=True)
  thread.start()
  _filter.update(thread=thread)
  atexit.register(flush)


def flush(timeout_s: float = 5.0) -> None:
  """Everything written so far reaches the console: stdout's end of the pipe is closed, and the
  copying thread drains it (before an os._exit, or at exit)."""
  if not _filter:
    return
  sys.stdout.flush()
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 1)  # the pipe's last writer goes: the thread reads to its end
  os.close(null)
  _filter.pop("thread").join(timeout_s)
