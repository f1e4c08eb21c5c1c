"""What the processes of a distributed run (backend.mode="distributed", backend/distributed.py)
say to each other on the host, through JAX's coordination service and its key-value store.

Host values that only some processes hold (a step's metrics live on one island's process)
reach the others with `to_host`; `barrier` waits for every live process; `StopAgreement` makes
them stop at one step. Outside a distributed run `to_host` is `jax.device_get` and `barrier`
does nothing, so callers need no second path.

The live processes are every process of the run until elastic pods leave a dead one out
(`leave_out`, elastic/agreement.py), and again once a process started in its place is taken
back (`take_back`); `barrier` and `gather` span the live ones only, and so do the checkpoints'
barriers (checkpoint/checkpointer.py builds Orbax's for `live()`). A process started in a dead
one's place (`rejoining`) must agree with the others on everything they pair by counting:
`membership` is that, which it `adopt`s.
"""

import collections
import json
import os
import random
import signal
import socket

import jax
import numpy as np


def active() -> bool:
  """Whether this process has joined a distributed run."""
  from jax._src import distributed

  return distributed.global_state.client is not None


def _client():
  from jax._src import distributed

  return distributed.global_state.client


REJOIN_ENV = "PWTRAIN_REJOIN"  # "1": started in a dead process's place (pwtrain.launch)


def rejoining() -> bool:
  """Whether this process was started in the place of a dead one while the others went on
  (pwtrain.launch sets $PWTRAIN_REJOIN on it; elastic pods): it joins them at a step boundary
  (elastic/agreement.py) instead of starting the run with them."""
  return active() and os.environ.get(REJOIN_ENV) == "1"


_LEFT_OUT: set[int] = set()  # processes of the run taken for dead (elastic pods)
_GENERATION = [0]  # how often the live processes changed


def live() -> tuple[int, ...]:
  """The ids of the run's live processes, ascending: every process (just process 0 outside a
  distributed run), less those `leave_out` named."""
  return tuple(i for i in range(jax.process_count()) if i not in _LEFT_OUT)


def leave_out(ids) -> None:
  """Takes processes `ids` for dead from now on: `barrier`, `gather` and the checkpoints'
  barriers no longer wait for them. Every live process must leave out the same ones at the same
  point of the run (elastic/agreement.py does, once they agree which are gone)."""
  _LEFT_OUT.update(ids)
  _GENERATION[0] += 1
  tell_launcher(live())


def take_back(ids) -> None:
  """Processes `ids`, started again in the place of dead ones, are live again (`leave_out`)."""
  _LEFT_OUT.difference_update(ids)
  _GENERATION[0] += 1
  tell_launcher(live())


# The line on which process 0 tells pwtrain.launch which processes the run's barriers wait for.
LAUNCHER_LINE = "[pwtrain:barriers]"


def tell_launcher(ids) -> None:
  """Process 0 of a run pwtrain.launch started: prints, on a line of its own that the launcher
  reads and does not echo, the processes that the run's barriers (JAX's live-nodes barrier
  included) wait for from now on. The launcher starts a dead process again only once it is not
  among them: a process started again while the others may still be in a live-nodes barrier
  over its id would be live in that barrier without ever entering it, and they would wait
  forever (`launch.barrier_line`)."""
  line = f"{LAUNCHER_LINE} {','.join(str(i) for i in sorted(ids))}"
  if jax.process_index() == 0 and os.environ.get("PWTRAIN_LAUNCHER_PID") and line != _TOLD[0]:
    print(line, flush=True)
    _TOLD[0] = line


_TOLD = [""]  # the last line `tell_launcher` printed


def generation() -> int:
  """How often the live processes changed (0: never), the same on every live process."""
  return _GENERATION[0]


def membership() -> dict:
  """What a process started in a dead one's place must adopt (`adopt`) to pair with the others:
  the live processes' generation, those left out, and every `next_key` count."""
  return {"generation": _GENERATION[0], "left_out": sorted(_LEFT_OUT), "counts": dict(_COUNTS)}


def adopt(said: dict) -> None:
  """Takes on the others' `membership()`."""
  _GENERATION[0] = said["generation"]
  _LEFT_OUT.clear()
  _LEFT_OUT.update(said["left_out"])
  _COUNTS.clear()
  _COUNTS.update(said["counts"])


def share(key: str, value, replace: bool = False) -> None:
  """Publishes a tree of host scalars/arrays under `key` to every process (see `ask`);
  `replace`: a value already there (a dead predecessor's) is deleted first."""
  if replace:
    _client().key_value_delete(f"pwtrain/{key}")
  _client().key_value_set(f"pwtrain/{key}", json.dumps(_encode(value)))


def tell(key: str, value) -> None:
  """Publishes JSON-serialisable `value` under `key`, replacing what was there (`hear`)."""
  _client().key_value_delete(f"pwtrain/{key}")
  _client().key_value_set(f"pwtrain/{key}", json.dumps(value))


def hear(key: str, timeout_s: float = 600.0):
  """The value `tell`-ed under `key`, waiting for it at most `timeout_s`."""
  return json.loads(_client().blocking_key_value_get(f"pwtrain/{key}", int(timeout_s * 1000)))


def told(key: str):
  """The value `tell`-ed under `key` now, without waiting; None if there is none."""
  try:
    return json.loads(_client().key_value_try_get(f"pwtrain/{key}"))
  except jax.errors.JaxRuntimeError as e:
    if _status(e) != "NOT_FOUND":
      raise
    return None


def ask(key: str, timeout_s: float = 600.0):
  """The value another process `share`d under `key`, waiting for it at most `timeout_s`."""
  raw = _client().blocking_key_value_get(f"pwtrain/{key}", int(timeout_s * 1000))
  return _decode(json.loads(raw))


def gather(key: str, value, timeout_s: float = 600.0) -> list:
  """Every live process's JSON-serialisable `value` given under `key`, in the order of `live()`,
  on every live process alike ([value] outside distributed mode). Every live process must call
  it with `key`."""
  if not active():
    return [value]
  client = _client()
  client.key_value_set(f"pwtrain/{key}/{jax.process_index()}", json.dumps(value))
  return [
    json.loads(client.blocking_key_value_get(f"pwtrain/{key}/{i}", int(timeout_s * 1000)))
    for i in live()
  ]


def agree(key: str, value, among) -> dict[int, tuple[int, object]]:
  """{process: (incarnation, its JSON-serialisable `value`)} of the processes of `among` that
  are live, the same on every one of them: each tells its value under `key`, then waits in JAX's
  live-nodes barrier (`jax_enable_recoverability`: the barrier waits for the live processes of
  `among` only, and a process that died is found by its missing heartbeats), so every process
  the barrier finds live told its value before it. An incarnation changes when a process of
  that id was started again. Every live process of `among` must call it with `key`."""
  client = _client()
  client.key_value_set(f"pwtrain/{key}/{jax.process_index()}", json.dumps(value))
  live = client.get_live_nodes(sorted(among))
  return {
    i: (incarnation, json.loads(client.blocking_key_value_get(f"pwtrain/{key}/{i}", 60_000)))
    for i, incarnation in sorted(live.items())
  }


def forget_collectives(device_ids) -> list[str]:
  """Deletes what Gloo (the CPU collectives of a run of several processes) left in the
  key-value store for its contexts over any of `device_ids` ("cpu:gloo/<ids>/<n>"), which a
  process started in a dead one's place makes again: Gloo refuses to set a key that exists
  ("Gloo context initialization failed: ALREADY_EXISTS"). Returns the keys deleted."""
  client, ids = _client(), {str(i) for i in device_ids}
  gone = []
  for key, _ in client.key_value_dir_get_bytes("cpu:gloo/"):
    group = key.removeprefix("cpu:gloo/").split("/")[0]
    if ids & set(group.split(",")):
      client.key_value_delete(key)
      gone.append(key)
  return gone


_COUNTS: collections.Counter = collections.Counter()


def next_key(what: str) -> str:
  """A key for `to_host` that no earlier call of this process used: "<what>/<n>" for the n-th
  call with `what`. Processes that make their calls with one `what` in the same order (from one
  thread) get the same keys."""
  n = _COUNTS[what]
  _COUNTS[what] = n + 1
  return f"{what}/{n}"


class StopAgreement:
  """Processes that agree on the step at which to stop (a SIGTERM reaches them at different
  steps, but they must save the same checkpoint and stop together).

  `at(step, requested)` is asked by every process after every step: the first process that was
  asked to stop proposes `step + margin` through the key-value store (later proposals are
  ignored), and every process stops once it has finished the proposed step. `margin` must cover
  how far processes can run apart (the run-ahead bound, plus one)."""

  KEY = "pwtrain/stop_at"

  def __init__(self, margin: int):
    self.margin = margin
    self.proposed = False
    self.stop_at: int | None = None

  def at(self, step: int, requested: bool) -> bool:
    client = _client()
    if requested and not self.proposed:
      self.proposed = True
      try:
        client.key_value_set(self.KEY, str(step + self.margin))
      except jax.errors.JaxRuntimeError as e:  # another process proposed first: its step stands
        if _status(e) != "ALREADY_EXISTS":
          raise
    if self.stop_at is None:  # another process may have proposed: one local RPC per step
      try:
        self.stop_at = int(client.key_value_try_get(self.KEY))
      except jax.errors.JaxRuntimeError as e:  # not found: nobody asked to stop yet
        if _status(e) != "NOT_FOUND":
          raise
        self.stop_at = None
    if self.stop_at is not None and step > self.stop_at:
      raise RuntimeError(
        f"processes were asked to stop after step {self.stop_at} but this one is at {step}: "
        "they ran further apart than the agreement's margin"
      )
    return self.stop_at == step


def barrier(name: str, timeout_s: float = 600.0) -> None:
  """Waits until every live process (`live()`) has reached the barrier `name` (no-op outside
  distributed mode)."""
  if not active():
    return
  if _LEFT_OUT:
    _client().wait_at_barrier(f"pwtrain/{name}", int(timeout_s * 1000), process_ids=list(live()))
  else:
    _client().wait_at_barrier(f"pwtrain/{name}", int(timeout_s * 1000))


def to_host(tree, key: str, timeout_s: float = 600.0):
  """`tree`'s arrays as numpy arrays, on every process alike (jax.device_get outside distributed
  mode). An array whose data this process holds (on its own islands, or replicated across an
  island it is part of) is read here, and the lowest such process publishes it under `key`; the
  others wait for that. Every process must call it with the same `key`, which names this call
  uniquely (say "metrics/<n>")."""
  if not active():
    return jax.device_get(tree)
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for i, x in enumerate(leaves):
    name = f"host/{key}/{i}"
    if not isinstance(x, jax.Array):
      out.append(np.asarray(x))
    elif x.is_fully_addressable or (x.is_fully_replicated and x.addressable_shards):
      value = np.asarray(x.addressable_shards[0].data if not x.is_fully_addressable else x)
      if jax.process_index() == min(d.process_index for d in x.sharding.device_set):
        share(name, value)
      out.append(value)
    else:
      if x.addressable_shards:
        raise NotImplementedError(
          f"{key}: an array sharded across processes cannot be read on the host here"
        )
      out.append(ask(name, timeout_s))
  return jax.tree.unflatten(treedef, out)


def _encode(value):
  if isinstance(value, dict):
    return {"dict": {k: _encode(v) for k, v in value.items()}}
  a = np.asarray(value)
  return {"array": a.tolist(), "dtype": a.dtype.str}


def _decode(obj):
  if "dict" in obj:
    return {k: _decode(v) for k, v in obj["dict"].items()}
  return np.asarray(obj["array"], dtype=np.dtype(obj["dtype"]))


def describe_exit(code: int) -> str:
  """How a child process ended, from its return code: "was killed by SIGKILL", "exited with
  status 1"."""
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with status {code}"


def _status(error: Exception) -> str:
  """The status code a coordination-service call failed with ("NOT_FOUND", "ALREADY_EXISTS",
  ...): the start of JAX's message."""
  return str(error).split(":", 1)[0].strip()


def free_port(host: str = "127.0.0.1") -> int:
  """A port free now on `host` for a process of the run to listen on later (the coordinator,
  JAX's cross-host transfer socket, which binds only at the first transfer between processes).
  Drawn below the kernel's ephemeral range (ip_local_port_range): a port the kernel hands out
  (port 0) may be given to any outgoing connection on a busy host before the process binds it
  ("bind: Address already in use"); one below that range is taken only by another explicit bind."""
  low = _ephemeral_low()
  draw = random.Random()  # seeded from the OS: processes and launchers do not draw alike
  for _ in range(64):
    port = draw.randrange(max(1024, low - 16384), low)
    with socket.socket() as s:
      try:
        s.bind((host, port))
      except OSError:
        continue
      return port
  with socket.socket() as s:  # a host whose low ports are all taken: the kernel's choice
    s.bind((host, 0))
    return s.getsockname()[1]


def _ephemeral_low() -> int:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768  # Linux's default; other systems' ranges start higher
