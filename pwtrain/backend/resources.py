"""The resource manager: places a program's virtual islands on the cluster's physical islands.

Each client (a training job, a benchmark, another program) asks for a number of islands of a
given size. The least-loaded suitable islands are chosen, so independent clients spread over the
cluster and, when islands are scarce, share them; work from clients that share an island is
gang-scheduled by that island's single queue (see controller.py).
"""

import collections

from pwtrain.backend.cluster import Cluster, Island
from pwtrain.errors import ConfigError


class ResourceManager:
  def __init__(self, cluster: Cluster):
    self.cluster = cluster
    self._load: collections.Counter = collections.Counter()
    self._held: dict[str, tuple[Island, ...]] = {}

  def allocate(self, client: str, num_islands: int, devices_per_island: int) -> tuple[Island, ...]:
    """Islands for `client`'s virtual islands 0..num_islands-1, in cluster order."""
    if client in self._held:
      raise ConfigError(f"client {client!r} already holds islands; release them first")
    order = {island.name: k for k, island in enumerate(self.cluster.islands)}
    fits = [i for i in self.cluster.islands if i.num_devices == devices_per_island]
    if len(fits) < num_islands:
      raise ConfigError(
        f"{num_islands} islands of {devices_per_island} devices requested, but the cluster has "
        f"{len(fits)} such islands (sizes: {[i.num_devices for i in self.cluster.islands]})"
      )
    chosen = sorted(fits, key=lambda i: (self._load[i.name], order[i.name]))[:num_islands]
    chosen = tuple(sorted(chosen, key=lambda i: order[i.name]))
    for island in chosen:
      self._load[island.name] += 1
    self._held[client] = chosen
    return chosen

  def release(self, client: str) -> None:
    for island in self._held.pop(client):
      self._load[island.name] -= 1

  def load(self, island: str) -> int:
    """How many clients currently hold `island`."""
    return self._load[island]
