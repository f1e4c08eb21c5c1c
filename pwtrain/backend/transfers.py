"""How values move between islands and processes: a transfer's put onto its island, whether a
process holds part of an island, and the order in which the processes of a distributed run
issue the transfers between them. (What a process holds of another process's output is
`sharding.stand_in`.)
"""

import jax
import numpy as np

from pwtrain.backend.program import Program, Transfer
from pwtrain.sharding import from_host


def dispatch_order(program: Program, islands) -> tuple:
  """`program.nodes` with each transfer between islands of different processes moved up to
  just after the node whose output it sends (in their order), so that a send is issued before
  its island's next computation is launched: a device runs a send issued after its next
  computation only after that computation (Controller._dispatch_local). A function of the
  program and the islands only: every process gets the same order, as JAX's pairing of a
  cross-host transfer's two sides (by how many each process has issued) needs."""
  owners = {i.name: i.processes for i in islands}
  island_of = {n.name: n.island for n in program.nodes}
  after: dict[str, list] = {}
  for node in program.nodes:
    if isinstance(node, Transfer) and not isinstance(node.src, str):
      if owners[island_of[node.src[0]]] != owners[node.island]:
        after.setdefault(node.src[0], []).append(node)
  hoisted = {t.name for ts in after.values() for t in ts}
  order = []
  for node in program.nodes:
    if node.name not in hoisted:
      order.extend([node, *after.get(node.name, ())])
  return tuple(order)


def device_put(sharding):
  """Puts a value onto `sharding` (one sharding, or a tree of them matching the value). A host
  value onto a sharding over several processes (an island that spans them) is read only where
  this process's devices hold it: each process feeds its own rows of a batch, and the others'
  rows may be placeholders. Device values go in one jax.device_put call, as before: JAX pairs
  a cross-process transfer's two sides by counting such calls on each process."""
  spans_processes = not all(s.is_fully_addressable for s in jax.tree.leaves(sharding))

  def put(x):
    if not spans_processes or any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
      return jax.device_put(x, sharding)
    one = isinstance(sharding, jax.sharding.Sharding)
    return jax.tree.map(_from_host, x, jax.tree.map(lambda _: sharding, x) if one else sharding)

  return put


def _from_host(value, sharding):
  value = np.asarray(value)
  return from_host(value, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))


def has_local_devices(island) -> bool:
  """Whether some of `island`'s devices belong to this process (always, outside distributed
  mode; remote islands' stand-ins are local devices)."""
  here = jax.process_index()
  return any(getattr(d, "process_index", here) == here for d in island.devices)
