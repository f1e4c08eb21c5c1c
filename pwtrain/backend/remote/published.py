"""What a remote controller has published (Controller.start_publishing, program.Latest).

A worker runs the operations it is sent strictly in the order they arrive, so publishing happens
as a program is sent: the newest carried output (a train state) sent to be made on an island is
the newest made there before anything sent now. A node's `Latest` input is resolved when its
program is sent, to that value where it lives on the worker: with `keys`, a `handle#i,j,...`
argument naming the leaves of those entries, which the worker picks out of the value in its
store (server.py), without a copy. The next program to donate the value is sent after the
reader, so the worker runs the reader first.
"""

import jax

from pwtrain.backend.program import Latest, NotPublished
from pwtrain.backend.remote.values import Ref, RemoteValue


class Published:
  """The newest published value per (island, name)."""

  def __init__(self, cluster):
    self.cluster = cluster
    self._values: dict[tuple[str, str], RemoteValue] = {}

  def sent(self, program, out: dict) -> None:
    """A program was sent: its carried outputs, `out`'s RemoteValues, are the newest under
    their names on their islands (an output passed through as it is was published before)."""
    for name in program.carried:
      if isinstance(out[name], RemoteValue):
        self._values[(out[name].island, name)] = out[name]

  def put(self, island: str, name: str, value) -> None:
    """`value` published under `name` on `island`, if it is a program's output made there; a
    value still on the controller's host (a run's initial or restored state, which its first
    step uploads) is not copied to the worker for it: that step's outputs are the first."""
    if isinstance(value, RemoteValue) and value.island == island:
      self._values[(island, name)] = value

  def forget(self, island: str) -> None:
    """What was published on `island` went with its worker's store (a rejoin starts afresh; the
    programs that give it its state again publish anew)."""
    self._values = {k: v for k, v in self._values.items() if k[0] != island}

  def resolve(self, latest: Latest, island: str) -> Ref:
    """The newest value under `latest.name` on `island`, or with `latest.keys` those entries of
    it. NotPublished if there is none; the lost island's error if the program that made it ran
    on an island lost since (its step failed with the loss, and runs again)."""
    value = self._values.get((island, latest.name))
    if value is None:
      raise NotPublished(f"nothing is published as {latest.name!r} on {island} yet")
    ref = value.ref
    for suspect in sorted(ref.islands):
      if self.cluster[suspect].worker.lost:
        raise self.cluster[suspect].worker.lost_error()
    if not latest.keys:
      return ref
    positions = jax.tree.unflatten(ref.treedef, range(len(ref.avals)))
    leaves, treedef = jax.tree.flatten({k: positions[k] for k in latest.keys})
    handle = f"{ref.handle}#{','.join(map(str, leaves))}"
    return Ref(ref.worker, handle, treedef, tuple(ref.avals[i] for i in leaves), ref.islands)
