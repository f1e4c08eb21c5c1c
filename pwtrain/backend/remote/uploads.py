"""A program's values sent from the controller's host to its workers (remote/dispatch.py), as
Put streams that the program's operations wait for (remote/sending.py).

  inputs      the host inputs that a worker's nodes read (the serving engine's tokens,
              positions and sampling settings; a step's number): every leaf of them in one
              value there, `{prefix}/in@island`, one stream however many inputs, each input
              read as its leaves of it (`handle#i,j`, ordered.parse_arg). The worker counts a
              read of some leaves as a read of the value (remote/server.py), which it drops
              after the last of the program's reads.
  transfers   a host input that a Transfer moves onto an island: its own value there, placed
              in the transfer's shardings as it arrives.
"""

import jax
import numpy as np

from pwtrain.backend.remote.values import Ref


class Uploads:
  """The uploads of one program: `prefix` names its values; `islands`, the program's (a failed
  read's suspects)."""

  def __init__(self, prefix: str, islands: frozenset):
    self.prefix, self.islands = prefix, islands
    self.calls: list = []  # [(worker, future of its Put)], started
    self._packed: dict = {}  # worker -> ([host leaves], reads): its inputs' one value

  def input(self, worker, name: str, value, reads: int) -> Ref:
    """Host input `name`, which nodes on `worker` read `reads` times, in that worker's one
    value."""
    leaves, treedef = jax.tree.flatten(value)
    if not leaves:  # nothing to index: a value of its own
      return self.transfer(worker, name, value, None, reads)
    host, n_reads = self._packed.get(worker, ([], 0))
    first = len(host)
    host.extend(np.asarray(x) for x in leaves)
    self._packed[worker] = (host, n_reads + reads)
    handle = f"{self._input_handle(worker)}#{','.join(map(str, range(first, len(host))))}"
    avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in host[first:])
    return Ref(worker, handle, treedef, avals, self.islands)

  def transfer(self, worker, name: str, value, shardings, uses: int) -> Ref:
    """`value` uploaded now as a value of its own, `name`, placed in `shardings` (or None)."""
    leaves, treedef = jax.tree.flatten(value)
    host = [np.asarray(x) for x in leaves]
    handle = f"{self.prefix}/{name}@{worker.island}"
    self.calls.append((worker, worker.put_async(handle, host, shardings, uses)))
    avals = tuple(
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
      for x, s in zip(host, shardings or [None] * len(host), strict=True)
    )
    return Ref(worker, handle, treedef, avals, self.islands)

  def start(self) -> list:
    """Starts each worker's upload of its inputs; every call of the program's uploads."""
    for worker, (host, reads) in self._packed.items():
      call = worker.put_async(self._input_handle(worker), host, None, reads)
      self.calls.append((worker, call))
    self._packed = {}
    return self.calls

  def _input_handle(self, worker) -> str:
    return f"{self.prefix}/in@{worker.island}"
