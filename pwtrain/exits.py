"""How the launcher (launch.py) reads the ends of a run's processes: which one failed the run,
and which ends are no failure of it. `codes` are Popen return codes: None while running, -s
when signal s ended the process.
"""

import time

# How long the launcher looks again when the first failure it sees is an exit with a status: a
# peer that a signal ended just before may still be being torn down (a kill is a cause; a
# peer's exit with a status, its collectives broken, is most often the consequence).
CAUSE_S = 0.5


def status(code: int) -> int:
  """An exit status as a shell shows it: killed by signal s -> 128 + s."""
  return 128 - code if code < 0 else code


def first_failed(codes: list, left: set[int]) -> int | None:
  """The process whose end failed the run, of those ended and not left out: one a signal
  ended first (both may be seen ended at once), else the lowest."""
  ended = [i for i, c in enumerate(codes) if c not in (None, 0) and i not in left]
  return min(ended, key=lambda i: (codes[i] > 0, i), default=None)


def failed_cause(procs, left: set[int], wait_s: float = CAUSE_S) -> int | None:
  """first_failed of `procs` (Popens) now; if that one exited with a status, of them again
  after `wait_s`, so that a peer a signal ended just before is the one named."""
  failed = first_failed([p.poll() for p in procs], left)
  if failed is not None and procs[failed].returncode > 0:
    time.sleep(wait_s)
    failed = first_failed([p.poll() for p in procs], left)
  return failed


def late_rejoins(codes: list[int], left: set[int], starts, drops: bool) -> list[int]:
  """With elastic pods (`drops`) and process 0 done (exit 0: the run finished, its checkpoints
  written by process 0), the processes started again that exited non-zero without being left
  out: they could not rejoin a run that had ended, which is no failure of the run."""
  if not drops or codes[0] != 0:
    return []
  return [i for i, c in enumerate(codes) if i and c and starts[i] and i not in left]
