"""What a remote controller has published (Controller.start_publishing, program.Latest).

The carried outputs (a train state) of an ordinary program are published on their worker as it
runs: the Execute that makes one names it (Op.publishes), and the worker keeps the newest under
each name. A node's `Latest` input is sent as `@name=<handle>`: the newest value published
under `name` on the worker when the node runs, or, before the worker has run any program that
publishes it, `handle`, the newest such value the controller has sent to be made there. With
`keys`, `#i,j,...` names the leaves of those entries, which the worker picks out of the value in
its store (server.py), without a copy. A reader runs before the next program to donate the value
(the worker's queue keeps one order: ordered.py), so it reads it first; a priority reader placed
ahead of queued steps reads the state of the latest step run before it, as on an embedded
island. A value published by Controller.publish (made by a program that did not publish it) is
named by its handle alone.
"""

import dataclasses

import jax

from pwtrain.backend.program import Latest, NotPublished
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote.values import Ref, RemoteValue


class Published:
  """The newest published value per (island, name)."""

  def __init__(self, cluster):
    self.cluster = cluster
    self._values: dict[tuple[str, str], RemoteValue] = {}
    self._by_worker: set = set()  # (island, name): the newest was published by its worker

  @staticmethod
  def publishes(program, node) -> list:
    """The Op.publishes of `node` of `program`: its outputs carried out of the program."""
    return [
      pb.Publish(name=name, output=program.outputs[name][1])
      for name in program.carried
      if not isinstance(program.outputs[name], str) and program.outputs[name][0] == node.name
    ]

  def sent(self, program, out: dict) -> None:
    """A program was sent: its carried outputs, `out`'s RemoteValues, are the newest under
    their names on their islands (an output passed through as it is was published before)."""
    for name in program.carried:
      if isinstance(out[name], RemoteValue):
        self._values[(out[name].island, name)] = out[name]
        self._by_worker.add((out[name].island, name))

  def put(self, island: str, name: str, value) -> None:
    """`value` published under `name` on `island`, if it is a program's output made there; a
    value still on the controller's host (a run's initial or restored state, which its first
    step uploads) is not copied to the worker for it: that step's outputs are the first."""
    if isinstance(value, RemoteValue) and value.island == island:
      self._values[(island, name)] = value
      self._by_worker.discard((island, name))

  def forget(self, island: str) -> None:
    """What was published on `island` went with its worker's store (a rejoin starts afresh; the
    programs that give it its state again publish anew)."""
    self._values = {k: v for k, v in self._values.items() if k[0] != island}
    self._by_worker = {k for k in self._by_worker if k[0] != island}

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
    handle = ref.handle
    if (island, latest.name) in self._by_worker:
      handle = f"@{latest.name}={handle}"
    if not latest.keys:
      return dataclasses.replace(ref, handle=handle)
    positions = jax.tree.unflatten(ref.treedef, range(len(ref.avals)))
    leaves, treedef = jax.tree.flatten({k: positions[k] for k in latest.keys})
    handle = f"{handle}#{','.join(map(str, leaves))}"
    return Ref(ref.worker, handle, treedef, tuple(ref.avals[i] for i in leaves), ref.islands)
