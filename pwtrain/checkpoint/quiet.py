"""A damaged checkpoint read quietly: Orbax abandons the reads of the other arrays when one
fails, and their deaths would print pages of tracebacks around the one line the caller reports.

Both guards here swap Python's last-resort hooks (sys.excepthook, sys.unraisablehook) for the
length of one restore, the only place those abandoned coroutines die, and put them back after;
`tests/test_reliability.py::test_a_damaged_checkpoint_prints_one_line_not_tracebacks` is the
test that shows they are needed (a truncated array file: one line on stderr, not pages). Orbax
offers no way to cancel or await the reads it abandons, so there is no cleaner place to do it.
"""

import contextlib
import gc
import logging
import os
import sys
import time

log = logging.getLogger(__name__)


# How long a failed read waits for the reads Orbax abandoned (measured by the test named in the
# module doc, run 40 and 80 times). Their TensorStore callbacks, when
# they fire after the read's event loop has closed, print "RuntimeError: Event loop is closed"
# around Python's hooks (neither sys.excepthook nor sys.unraisablehook sees it; Orbax's loop is
# closed before its error reaches us, and TensorStore's futures cannot be found to wait on): 2
# of 40 runs of a truncated-file restore printed it without the wait, 0 of 80 with it. Only a
# damaged checkpoint pays it.
_ABANDONED_READS_S = 0.5


@contextlib.contextmanager
def quiet_if_failed():
  """Holds back what a failing read prints on its way down, and drops it if the read fails.

  When one array of a damaged checkpoint cannot be read, Orbax abandons the reads of the others:
  their coroutines die with "Event loop is closed" or their own TensorStore error, which Python
  prints through sys.excepthook / sys.unraisablehook, pages of tracebacks around the one line
  the caller reports. These are collected here (a garbage collection at the end lets the
  abandoned coroutines finish dying inside, once nothing holds the read's exception: its
  traceback keeps them alive, so the caller drops it inside); if the read failed they are
  logged at DEBUG only, and if it succeeded they are passed on to the hooks as usual. Those
  that die later are `abandoned_reads_dropped`'s.
  """
  held = []
  saved = sys.excepthook, sys.unraisablehook
  sys.excepthook = lambda *exc: held.append((saved[0], exc))
  sys.unraisablehook = lambda unraisable: held.append((saved[1], (unraisable,)))
  failed = True
  try:
    yield
    failed = False
  finally:
    if failed:  # let the reads Orbax abandoned finish while the guard holds (see above)
      time.sleep(_ABANDONED_READS_S)
    gc.collect()
    sys.excepthook, sys.unraisablehook = saved
    for hook, args in held:
      if failed:
        log.debug("while reading a damaged checkpoint: %s", args)
      else:
        hook(*args)


@contextlib.contextmanager
def abandoned_reads_dropped():
  """While a restore and its fallbacks run: the death of a read coroutine Orbax abandoned when
  another array of the checkpoint failed goes to the DEBUG log, not to stderr. Some die only
  when Orbax drops what held them, at the next restore (the fallback to the step before); every
  other unraisable error reaches the hook that was there before, and that hook is back when the
  restore is done (after a garbage collection lets the last of them die inside)."""
  previous = sys.unraisablehook

  def hook(unraisable):
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
      log.debug("an abandoned checkpoint read died: %s", unraisable.exc_value)
    else:
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    gc.collect()
    sys.unraisablehook = previous


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
