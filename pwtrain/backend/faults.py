"""Lost islands: how the runtime says that an island can no longer run.

An island is lost when its devices fail (embedded mode; on Pathways on Cloud a slice going down
shows up as errors on that slice's arrays), when its worker dies or goes silent (remote mode),
or when a drill says so (`fault.inject`). Every node of a lost island then fails with
`IslandLost` instead of running, and so does every node that reads one of its outputs: the step
in flight fails with it, naming the island and the cause, and the trainer decides what follows
(pwtrain/elastic/ drops the island's pod and carries on without it).
"""

# How a runtime reports devices that are gone (a failed chip, a slice down under Pathways): the
# status codes of such errors. Any other error of a computation (out of memory, a bad program)
# is the program's, and stays what it is.
_LOSS_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED")


def is_device_loss(error: BaseException) -> bool:
  """Whether `error`, raised by a computation, says that its devices are gone."""
  import jax  # the exception type only

  return isinstance(error, jax.errors.JaxRuntimeError) and str(error).startswith(_LOSS_CODES)


class IslandLost(RuntimeError):
  """`island` can no longer run (`cause` says why)."""

  def __init__(self, island: str, cause: str):
    super().__init__(f"island {island} lost: {cause}")
    self.island = island
    self.cause = cause


def read_of_lost(value, lost: dict) -> "IslandLost | None":
  """The loss behind a failed read of `value` (arrays, or trees of them): the IslandLost of a
  lost island (`lost`: {island's device: its IslandLost}) one of whose arrays is gone (deleted
  with its island, as a real loss leaves it), else None."""
  import jax  # the array type only

  for x in jax.tree.leaves(value):
    if isinstance(x, jax.Array) and x.is_deleted():
      for device in x.sharding.device_set:
        if device in lost:
          return lost[device]
  return None


def may_be_a_peers_death(error: BaseException) -> bool:
  """Whether `error` may be how a peer's death reached this process: an error of JAX's runtime
  (a transfer from the peer, a collective with it, a call to the coordination service) or an
  island found lost, anywhere in its chain. Any other exception is this process's own (a bug,
  a bad value): its traceback is printed at once, without waiting for JAX's verdict."""
  import jax  # the exception type only

  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, (jax.errors.JaxRuntimeError, IslandLost)):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False
