"""`overlapped`: `sync`'s sum, sent chunk by chunk while the backward still runs.

With one pipeline stage, each pod's model is cut into `exchange.buckets` chunks (cells on the
pod's island) differentiated one after another, and a chunk's gradients are sent as soon as it
is done, so the transfer overlaps the backward of the chunks before it. Same numerics as sync.
"""

from pwtrain.parallel.exchange.sync import Sync


class Overlapped(Sync):
  mode = "overlapped"

  def cells_per_pod(self, num_stages: int, num_layers: int) -> int:
    if num_stages == 1:
      return min(self.cfg.buckets, num_layers)
    return num_stages

  def exposed_s(self, transfer_s, compute_s, num_layers):
    if compute_s is None:
      return None
    # A bucket's transfer hides under the backward of the buckets after it; the last bucket's
    # is always exposed.
    buckets = min(self.cfg.buckets, num_layers)
    backward_s = compute_s * 2 / 3
    return max(transfer_s / buckets, transfer_s - backward_s * (buckets - 1) / buckets)
