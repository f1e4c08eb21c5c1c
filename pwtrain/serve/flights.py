"""The serving engine's programs in flight (engine.py): each dispatched program's outputs with
the sequence each row serves (`Flight`), and the thread that waits for them in dispatch order
and wakes the engine (`Landing`).
"""

import dataclasses
import queue
import threading

import jax


@dataclasses.dataclass
class Flight:
  """A dispatched program: its outputs, and which sequence each row's token is for."""

  outputs: dict
  rows: dict  # row -> sequence
  ready: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None


class Landing:
  """One thread that waits for each flight's outputs in turn (programs run in the order they
  were dispatched), marks it ready (or failed), and wakes the engine."""

  def __init__(self, lock: threading.Condition, loss_behind):
    """`loss_behind`: Controller.loss_behind, which names the lost island behind a failed read
    (an output deleted with its island) as that island's IslandLost."""
    self._lock = lock
    self._loss_behind = loss_behind
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._loop, name="serve-landing", daemon=True)
    self._thread.start()

  def watch(self, flight: Flight) -> None:
    self._queue.put(flight)

  def _loop(self) -> None:
    while (flight := self._queue.get()) is not None:
      values = None
      try:
        values = [f.result() for f in flight.outputs.values()]
        jax.block_until_ready(values)
      except BaseException as e:  # noqa: BLE001 - raised on the engine's thread
        lost = self._loss_behind(values) if isinstance(e, RuntimeError) and values else None
        flight.error = lost or e
      flight.ready.set()
      with self._lock:
        self._lock.notify()

  def stop(self) -> None:
    self._queue.put(None)
    self._thread.join()
