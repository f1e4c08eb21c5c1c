"""Turns SIGTERM / Ctrl-C into a request to checkpoint and stop at the next step boundary.

A second Ctrl-C interrupts at once (the last committed checkpoint is still intact).
"""

import signal
import threading


class StopRequest:
  def __init__(self):
    self._event = threading.Event()
    self._previous = {}

  @property
  def requested(self) -> bool:
    return self._event.is_set()

  def _handler(self, signum, frame):
    if self._event.is_set() and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self._event.set()

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handler)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
