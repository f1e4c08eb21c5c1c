"""A failed checkpoint read or write said in one line: what Orbax and TensorStore print on the
way down is kept off the console, and nothing else is.

When one array of a checkpoint cannot be read or written (a truncated file, a full disk), Orbax
abandons the reads or writes of the others and logs the failure, with its traceback, from each
thread it passes through (4 tracebacks for one failed save); the abandoned TensorStore
operations' callbacks then find Orbax's event loop closed and die as "unraisable" errors, one
traceback per array (hundreds in a real model). The caller reports the failure itself, in one
line (a damaged checkpoint set aside, a save that could not be written), so:

- `install()` (once per process, by the Checkpointer) puts a filter in front of Python's
  unraisable hook that takes exactly those deaths, an abandoned Orbax coroutine or a callback
  that met a closed event loop (`RuntimeError: Event loop is closed` from `call_soon_threadsafe`),
  to the DEBUG log, and passes every other unraisable error to the hook that was there. It is
  never swapped in or out while threads run; no exception hook (sys.excepthook,
  threading.excepthook) is touched.
- `OrbaxFailures`, a filter on the "absl" and "asyncio" loggers, holds the ERROR records of
  Orbax's operations (logged by its code, or of an exception raised in it) while an operation
  the caller watches runs (a restore, a save in flight); records of every other code pass as
  usual. The caller then drops them (the operation failed: it reports that itself; they go to
  the DEBUG log, as do those that come later) or lets them out.

`tests/test_reliability.py::test_a_damaged_checkpoint_prints_one_line_not_tracebacks` (a
truncated array file) and `tests/test_storage.py` (a save that meets a file size limit) show
they are needed.
"""

import contextlib
import gc
import logging
import os
import sys
import threading
import time
import warnings

log = logging.getLogger(__name__)


# How long a failed read waits for the reads Orbax abandoned (measured by the test named in the
# module doc, run 40 and 80 times): their TensorStore callbacks, when they fire after the read's
# event loop has closed, die as unraisable errors; 2 of 40 runs of a truncated-file restore
# printed one without the wait (before the unraisable filter), 0 of 80 with it. Only a damaged
# checkpoint pays it.
_ABANDONED_READS_S = 0.5


def _orbax_death(unraisable) -> bool:
  """Whether an unraisable error is the death of an operation Orbax abandoned."""
  code = getattr(unraisable.object, "cr_code", None)
  if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
    return True  # an abandoned Orbax coroutine, collected
  error = unraisable.exc_value
  if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
    return False
  frames = []
  tb = unraisable.exc_traceback
  while tb is not None:
    frames.append(tb.tb_frame.f_code.co_name)
    tb = tb.tb_next
  return "call_soon_threadsafe" in frames  # a foreign thread's callback to a closed loop


class _UnraisableFilter:
  """Python's unraisable hook, less `_orbax_death`s (to the DEBUG log)."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable):
    if _orbax_death(unraisable):
      log.debug("an abandoned checkpoint operation died: %r", unraisable.exc_value)
    else:
      self.previous(unraisable)


_install_lock = threading.Lock()
# Orbax's per-array write (orbax/checkpoint/_src/serialization/serialization.py).
_NEVER_STARTED = (
  r"coroutine 'async_serialize_from_host\.<locals>\.write_fragment' was never awaited"
)


def install() -> None:
  """The unraisable filter in front of the current hook, and `FAILURES` on Orbax's loggers,
  once per process."""
  with _install_lock:
    if not isinstance(sys.unraisablehook, _UnraisableFilter):
      sys.unraisablehook = _UnraisableFilter(sys.unraisablehook)
    # An array write Orbax abandoned before it started, collected (at the latest as the process
    # ends): Python warns of the coroutine, not through the unraisable hook.
    warnings.filterwarnings("ignore", _NEVER_STARTED, RuntimeWarning)
    for name in OrbaxFailures.LOGGERS:
      if FAILURES not in logging.getLogger(name).filters:
        logging.getLogger(name).addFilter(FAILURES)


def _from_orbax(record: logging.LogRecord) -> bool:
  """Whether Orbax's code logged `record`, or it reports an exception raised there (asyncio's
  "exception was never retrieved" of a write Orbax abandoned)."""
  if f"{os.sep}orbax{os.sep}" in record.pathname:
    return True
  error = record.exc_info[1] if record.exc_info else None
  if record.name == "asyncio" and "in OCDBT database" in str(error):
    return True  # a TensorStore write of Orbax's checkpoint format, failed in TensorStore's code
  tb = error.__traceback__ if error is not None else None
  while tb is not None:
    if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


class OrbaxFailures(logging.Filter):
  """On the "absl" and "asyncio" loggers (`install`): holds the ERROR records of Orbax's
  operations (`_from_orbax`) from `hold()` until `drop()` (to DEBUG) or `release()` (logged as
  they came); others pass. Held while any holder is (a count: a restore during a save in
  flight). After a drop, asyncio's that come late (an abandoned write's future collected) are
  dropped too: the failure was said."""

  LOGGERS = ("absl", "asyncio")

  def __init__(self):
    super().__init__()
    self._lock = threading.Lock()
    self._holders = 0
    self._dropped = False
    self._held: list[logging.LogRecord] = []

  def filter(self, record) -> bool:
    if record.levelno < logging.ERROR or not _from_orbax(record):
      return True
    with self._lock:
      if self._holders:
        self._held.append(record)
        return False
      if self._dropped and record.name == "asyncio":  # a write abandoned in a failure
        log.debug("Orbax, after a failure: %s", record.getMessage())
        return False
    return True

  def hold(self) -> None:
    install()
    with self._lock:
      self._holders += 1

  def _end(self, dropped: bool) -> list[logging.LogRecord]:
    with self._lock:
      self._holders -= 1
      self._dropped = self._dropped or dropped
      held, self._held = (self._held, []) if not self._holders else ([], self._held)
    return held

  def drop(self) -> None:
    for record in self._end(True):
      log.debug("Orbax, while failing: %s", record.getMessage())

  def release(self) -> None:
    for record in self._end(False):
      logging.getLogger(record.name).handle(record)


FAILURES = OrbaxFailures()  # one per process: the "absl" logger is


@contextlib.contextmanager
def quiet_if_failed():
  """Holds back what Orbax logs while a read runs, and drops it if the read fails (the caller
  reports it). A failing read first waits for the reads Orbax abandoned, and a garbage
  collection lets the abandoned coroutines die inside, once nothing holds the read's exception
  (its traceback keeps them alive, so the caller drops it inside)."""
  install()
  FAILURES.hold()
  failed = True
  try:
    yield
    failed = False
  finally:
    if failed:  # let the reads Orbax abandoned finish (see above)
      time.sleep(_ABANDONED_READS_S)
    gc.collect()
    FAILURES.drop() if failed else FAILURES.release()


@contextlib.contextmanager
def abandoned_reads_dropped():
  """While a restore and its fallbacks run: some reads Orbax abandoned die only when Orbax drops
  what held them, at the next restore (the fallback to the step before); a garbage collection
  at the end lets the last of them die while this process's filter (`install`) takes them."""
  install()
  try:
    yield
  finally:
    gc.collect()


class _ReadOnlyNotice(logging.Filter):
  def filter(self, record) -> bool:
    return not record.getMessage().startswith("Given directory is read only")


@contextlib.contextmanager
def read_only_notice_dropped():
  """While a reader's Orbax manager is made: Orbax's warning that its directory is read only
  (every reader's, by design: sampling, a finished run's state read back) stays off the
  console."""
  notice = _ReadOnlyNotice()
  absl_logger = logging.getLogger("absl")
  absl_logger.addFilter(notice)
  try:
    yield
  finally:
    absl_logger.removeFilter(notice)
