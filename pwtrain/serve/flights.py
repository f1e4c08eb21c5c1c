"""The serving engine's programs in flight (engine.py): each dispatched program's outputs with
the sequence each row serves (`Flight`), and the thread that waits for them in dispatch order,
copies them to the host and wakes the engine (`Landing`).

Outputs are copied to the host where they are waited for (`fetch`), so that an island lost
after a program ran cannot delete them between the wait and the read: a read that finds them
deleted with a lost island is that island's `IslandLost`, which the engine recovers from.
"""

import dataclasses
import queue
import threading


@dataclasses.dataclass
class Flight:
  """A dispatched program: its outputs (futures of arrays), which sequence each row's token is
  for, and once ready, the outputs on the host (`values`) or the error that stopped them."""

  outputs: dict
  rows: dict  # row -> sequence given a token
  serves: list  # every sequence it runs for (the prefilling ones, or the decoding ones)
  scored: tuple = ()  # (sequence, prompt tokens, row) each: an echo's prompt log-probs it gives
  ready: threading.Event = dataclasses.field(default_factory=threading.Event)
  values: dict | None = None
  error: BaseException | None = None


def fetch(outputs: dict, controller) -> dict:
  """`outputs` ({name: future of an array, or of a tree of them}) on the host, once computed
  (Controller.read: an output deleted with its lost island is that island's IslandLost)."""
  return controller.read({k: f.result() for k, f in outputs.items()})


class Landing:
  """One thread that fetches each flight's outputs in turn (programs run in the order they
  were dispatched), marks it ready (or failed), and wakes the engine."""

  def __init__(self, lock: threading.Condition, controller):
    """`controller`: the one that runs the flights' programs (see `fetch`)."""
    self._lock = lock
    self._controller = controller
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._loop, name="serve-landing", daemon=True)
    self._thread.start()

  def watch(self, flight: Flight) -> None:
    self._queue.put(flight)

  def _loop(self) -> None:
    while (flight := self._queue.get()) is not None:
      try:
        flight.values = fetch(flight.outputs, self._controller)
      except BaseException as e:  # noqa: BLE001 - raised on the engine's thread
        flight.error = e
      flight.ready.set()
      with self._lock:
        self._lock.notify()

  def stop(self) -> None:
    self._queue.put(None)
    self._thread.join()
