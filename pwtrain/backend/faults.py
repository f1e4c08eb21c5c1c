"""Lost islands: how the runtime says that an island can no longer run.

An island is lost when its devices fail (embedded mode; on Pathways on Cloud a slice going down
shows up as errors on that slice's arrays), when its worker dies or goes silent (remote mode),
or when a drill says so (`fault.inject`). Every node of a lost island then fails with
`IslandLost` instead of running, and so does every node that reads one of its outputs: the step
in flight fails with it, naming the island and the cause, and the trainer decides what follows
(pwtrain/elastic.py drops the island's pod and carries on without it).
"""


class IslandLost(RuntimeError):
  """`island` can no longer run (`cause` says why)."""

  def __init__(self, island: str, cause: str):
    super().__init__(f"island {island} lost: {cause}")
    self.island = island
    self.cause = cause
