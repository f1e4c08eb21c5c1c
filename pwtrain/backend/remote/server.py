"""The island worker: serves one island's devices to a remote controller over gRPC.

State: an object store of futures keyed by handle (store.py; values are flat lists of arrays), an
executable cache, and one execution queue drained by one thread, so the island runs every
program's computations in one order (gang scheduling): the order the controller enqueued them,
but for a priority client's, placed ahead of queued work the worker has not begun (ordered.py).
Transfers run beside the queue (receives.py): a Receive pulls its value straight from the worker
that holds it, and takes no place in the queue, so a node waiting for its inputs never holds up
a transfer.

Health says how the queue is doing: how many ops it has finished, and how long its current op
has run since its inputs and executable were there (`running_s`: grows on a wedged worker, whose
server still answers; the controller's monitor declares it lost past `fault.progress_timeout_s`).
Its `incarnation`, random per process, tells a worker started again from the one it replaced.

No silent copies. An Execute's device array that arrives in a sharding other than the one its
program takes (and not an equivalent one) is copied into that one: a transfer on the device the
controller did not ask for. Each such copy is counted (Health's `copied_inputs` and
`copied_bytes`) and logged, once per (program, input), with its bytes and both shardings
(tests/test_remote_scheduling.py). A training or serving run makes none (tests/test_remote.py,
tests/test_serve.py): the controller compiles every input, read or not, in the sharding its
value is made in (remote/dispatch.py). Host arrays uploaded without a sharding (a batch) are
placed where the program takes them, which is their upload.

A worker trusts nothing it is sent beyond the token: programs are StableHLO, arrays are bytes
with checked headers, and no message is ever unpickled.
"""

import concurrent.futures
import logging
import threading
import time
import uuid

import grpc
import jax
import numpy as np
import orbax.checkpoint as ocp

from pwtrain.backend.remote import arrays, auth
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote import protocol_pb2_grpc as pb_grpc
from pwtrain.backend.remote.channel import channel_options
from pwtrain.backend.remote.ordered import OpQueue, parse_arg
from pwtrain.backend.remote.receives import Receives, describe
from pwtrain.backend.remote.store import Store
from pwtrain.checkpoint import integrity
from pwtrain.checkpoint import parts as checkpoint_parts


class _Executable:
  def __init__(self, compiled, in_shardings, out_leaves):
    self.compiled = compiled
    self.in_shardings = in_shardings
    self.out_leaves = out_leaves


class Worker(pb_grpc.WorkerServicer):
  def __init__(self, island: str, devices=None):
    self.island = island
    self.devices = list(devices if devices is not None else jax.devices())
    self.platform = self.devices[0].platform
    self.store = Store()
    self._executables: dict[str, concurrent.futures.Future] = {}
    self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
    self.published: dict[str, str] = {}  # name -> the handle of the newest value published
    self._queue = OpQueue(self.published)
    self._receives = Receives(self)
    self.incarnation = uuid.uuid4().hex
    self._running_since = 0.0  # time.monotonic() the current op started running; 0: none
    self._done_ops = 0
    self.copied = {"inputs": 0, "bytes": 0}  # inputs copied to another sharding (module doc)
    self._copied_logged: set = set()  # (executable, input index) logged once
    self._saves: dict[str, concurrent.futures.Future] = {}  # ticket -> SaveReply
    self._saves_lock = threading.Lock()
    self._spans: list = []  # traced ops' (trace_id, start, end), until Timeline takes them
    self._spans_lock = threading.Lock()
    self.token = ""
    self.stopped = threading.Event()
    threading.Thread(target=self._run_queue, name="exec", daemon=True).start()

  # -- RPCs ---------------------------------------------------------------------------------

  def Health(self, request, context):
    return pb.HealthReply(
      island=self.island,
      num_devices=len(self.devices),
      platform=self.platform,
      pending_ops=len(self._queue),
      stored_values=len(self.store),
      time=time.time(),
      incarnation=self.incarnation,
      running_s=time.monotonic() - since if (since := self._running_since) else 0.0,
      done_ops=self._done_ops,
      copied_inputs=self.copied["inputs"],
      copied_bytes=self.copied["bytes"],
    )

  def Compile(self, request, context):
    if request.name in self._executables:
      context.abort(grpc.StatusCode.ALREADY_EXISTS, f"executable {request.name!r} exists")
    self._executables[request.name] = self._compiler.submit(self._compile, request)
    return pb.Empty()

  def Enqueue(self, request, context):
    queued, aliases = self._accept(request, context)
    self._queue.put(queued, request.program, request.priority, aliases)
    if request.release:  # ordinary, after every queued reader (ordered.py)
      self._queue.put_release((None, list(request.release)))
    return pb.Empty()

  def Offer(self, request, context):
    queued, aliases = self._accept(request, context)
    after = self._queue.offer(queued, aliases, list(request.pulled))
    if request.release:
      self._queue.put_release((None, list(request.release)))
    return pb.OfferReply(after=after)

  def Place(self, request, context):
    self._queue.place(request.after)
    return pb.Empty()

  def _accept(self, request, context):
    """An Enqueue's or Offer's ops: receives started, the rest as queue items, and {a local
    copy's handle: its source's} (ordered.py)."""
    queued, aliases = [], {}
    for op in request.ops:
      kind = op.WhichOneof("kind")
      if kind == "execute":
        outs = [self.store.create(o.handle, o.uses) for o in op.execute.outputs]
        queued.append((op, outs))
      elif kind == "save":
        with self._saves_lock:
          if op.save.ticket in self._saves:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"save {op.save.ticket!r} exists")
          self._saves[op.save.ticket] = concurrent.futures.Future()
        queued.append((op, None))
      else:
        out = self.store.create(op.receive.output.handle, op.receive.output.uses)
        self._receives.submit(op, out)
        if not op.receive.source:
          aliases[op.receive.output.handle] = op.receive.handle
    return queued, aliases

  def Put(self, request_iterator, context):
    try:
      first, leaves = arrays.from_chunks(request_iterator)
    except ValueError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    placed = [
      x if s is None else jax.device_put(x, arrays.sharding_from_proto(s, self.devices))
      for x, s in leaves
    ]
    self.store.create(first.handle, first.uses).set_result(placed)
    return pb.Empty()

  def Fetch(self, request, context):
    try:
      leaves = self.store.lookup(request.handle).result()
    except Exception as e:  # noqa: BLE001 - the failure travels to whoever fetches
      context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.handle}: {describe(e)}")
    if request.wait_only:  # computed: an empty stream, the value neither read nor released
      return
    try:
      yield from arrays.to_chunks(request.handle, [np.asarray(x) for x in leaves])
    finally:
      if request.release:
        self.store.release(request.handle)
      else:
        self.store.read(request.handle)

  def AwaitSave(self, request, context):
    with self._saves_lock:
      future = self._saves.get(request.ticket)
    if future is None:
      context.abort(grpc.StatusCode.NOT_FOUND, f"no save {request.ticket!r} on this worker")
    reply = future.result()
    with self._saves_lock:
      self._saves.pop(request.ticket, None)
    return reply

  def Abandon(self, request, context):
    n = self._receives.abandon(request.source)
    logging.warning("island %s: %d transfer(s) from %s abandoned", self.island, n, request.source)
    return pb.Empty()

  def Release(self, request, context):
    self._queue.put_release((None, list(request.handles)))
    return pb.Empty()

  def Shutdown(self, request, context):
    logging.info("island %s: shutdown requested by %s", self.island, context.peer())
    self.stopped.set()
    return pb.Empty()

  def Timeline(self, request, context):
    with self._spans_lock:
      spans, self._spans = self._spans, []
    return pb.TimelineReply(spans=[pb.Span(trace_id=i, start=a, end=b) for i, a, b in spans])

  def record(self, op, start: float) -> None:
    if op.trace_id:
      with self._spans_lock:
        self._spans.append((op.trace_id, start, time.time()))

  def Reset(self, request, context):
    logging.warning("island %s: reset by %s", self.island, context.peer())
    for op, outs in self._queue.drain():  # queued ops will never be read: fail their outputs
      for out in outs if op is not None and outs else ():
        if not out.done():
          out.set_exception(RuntimeError("the worker was reset"))
    self.store.reset()  # also ends an op blocked on an input of the old session
    self.published.clear()
    self._executables.clear()
    return pb.Empty()

  # -- work ---------------------------------------------------------------------------------

  def _compile(self, request) -> _Executable:
    exported = jax.export.deserialize(bytearray(request.exported))
    mesh = arrays.make_mesh(request.mesh_axes, request.mesh_shape, self.devices)
    if exported.nr_devices != mesh.size:
      raise ValueError(
        f"{request.name} was exported for {exported.nr_devices} devices; mesh has {mesh.size}"
      )
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    in_shardings = [s or replicated for s in exported.in_shardings_jax(mesh)]
    out_shardings = [arrays.sharding_from_proto(p, self.devices) for p in request.out_shardings]
    jitted = jax.jit(
      exported.call,
      in_shardings=in_shardings,
      out_shardings=out_shardings or None,
      donate_argnums=tuple(request.donate),
    )
    abstract = [
      jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
      for a, s in zip(exported.in_avals, in_shardings, strict=True)
    ]
    return _Executable(jitted.lower(*abstract).compile(), in_shardings, list(request.out_leaves))

  def _run_queue(self):
    while True:
      op, outs = self._queue.get()
      if op is None:  # a release, after every op enqueued before it has read its inputs
        for handle in outs:
          self.store.release(handle)
        continue
      try:
        if op.WhichOneof("kind") == "save":
          self._save(op.save)
          continue
        try:
          start = self._execute(op.execute, outs, block=bool(op.trace_id))
          self.record(op, start)
          for publish in op.publishes:  # before the next op is taken: ordered.py
            self.published[publish.name] = op.execute.outputs[publish.output].handle
        except BaseException as e:  # noqa: BLE001 - forwarded to whoever reads the outputs
          error = RuntimeError(f"{self.island}: {op.name} failed: {describe(e)}")
          logging.error("%s", error)
          for out in outs:
            if not out.done():
              out.set_exception(error)
        finally:
          for arg in op.execute.args:  # a value read whole or some leaves of it (`#i,j`)
            self.store.read(parse_arg(arg)[1])
      finally:
        self._running_since = 0.0  # idle, or waiting for the next op's inputs
        self._done_ops += 1

  def _leaves(self, arg: str) -> list:
    """The arrays of an Execute argument, once there: a handle, `<handle>#i,j,...` (leaves i,
    j, ... of it), `@<name>=<handle>` (the newest value published as `name` here, or `handle`
    if none is yet) or both (a published train state's params and step, read in place: the
    controller's program.Latest, remote/published.py)."""
    name, handle, picked = parse_arg(arg)
    leaves = self.store.lookup(self.published.get(name, handle)).result()
    return leaves if picked is None else [leaves[i] for i in picked]

  def _execute(self, op, outs, block: bool = False) -> float:
    """Runs an Execute; returns when its inputs were all there (when it could start)."""
    exe = self._executables[op.executable].result()
    leaves = []
    for handle in op.args:
      leaves.extend(self._leaves(handle))
    start = time.time()
    self._running_since = time.monotonic()  # Health's running_s: inputs and executable there
    if len(leaves) != len(exe.in_shardings):
      raise ValueError(f"{len(leaves)} input arrays; {op.executable} takes {len(exe.in_shardings)}")
    leaves = [
      self._placed(op.executable, i, x, s)
      for i, (x, s) in enumerate(zip(leaves, exe.in_shardings, strict=True))
    ]
    result = exe.compiled(*leaves)
    if self.platform == "cpu" or block:  # block: a traced op ends when its outputs are ready
      # XLA:CPU runs collectives on a shared thread pool: computations in flight together can
      # deadlock it (see Controller.serialize_execution), so each runs to completion first.
      jax.block_until_ready(result)
    first = 0
    for out, n in zip(outs, exe.out_leaves, strict=True):
      out.set_result(list(result[first : first + n]))
      first += n
    return start

  def _placed(self, executable: str, index: int, x, sharding):
    """Input `index` of `executable` in the sharding it takes: a host array placed there (its
    upload), a device array as it is if its sharding is that one or an equivalent, else copied
    into it, counted and logged (the module doc)."""
    if not isinstance(x, jax.Array):
      return jax.device_put(x, sharding)
    if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    self.copied["inputs"] += 1
    self.copied["bytes"] += x.nbytes
    if (executable, index) not in self._copied_logged:
      self._copied_logged.add((executable, index))
      logging.warning(
        "island %s: %s's input %d (%s, %d bytes) arrived as %s; the program takes %s: copied "
        "(further copies of it are counted in Health's copied_inputs, not logged)",
        self.island, executable, index, x.shape, x.nbytes, _spec(x.sharding), _spec(sharding),
      )  # fmt: skip
    return jax.device_put(x, sharding)

  def _save(self, op) -> None:
    """Phase one of a checkpoint on this island: reads the values now (in queue order, so before
    any later op donates them), copies them to the host, and writes them in the background.
    The outcome (fingerprints, or the error) waits for the controller's AwaitSave."""
    future = self._saves[op.ticket]

    def fail(e: BaseException) -> None:
      logging.error("island %s: save %s failed: %s", self.island, op.ticket, describe(e))
      future.set_result(pb.SaveReply(error=f"{self.island}: {describe(e)}"))

    try:
      tree = {}
      for item in op.items:
        value = self.store.lookup(item.handle).result()
        for index, name in zip(item.leaves, item.names, strict=True):
          checkpoint_parts.insert(tree, name, value[index])
      self._running_since = time.monotonic()  # its values are there (Health's running_s)
      # Fingerprinted on device before the queue goes on: what is written is what was computed.
      # The nested dict's paths are the names, so the keys are the whole-model paths.
      fingerprints = integrity.fingerprint(tree)
      saver = ocp.StandardCheckpointer()  # async: returns once the arrays are on the host
      saver.save(op.directory, tree)
    except BaseException as e:  # noqa: BLE001 - reported through AwaitSave
      fail(e)
      return

    def finish():
      try:
        saver.wait_until_finished()
        future.set_result(
          pb.SaveReply(names=list(fingerprints), fingerprints=list(fingerprints.values()))
        )
      except BaseException as e:  # noqa: BLE001 - reported through AwaitSave
        fail(e)
      finally:
        saver.close()

    threading.Thread(target=finish, name=f"save-{op.ticket}", daemon=True).start()


def _spec(sharding) -> str:
  return str(getattr(sharding, "spec", sharding))


def serve(
  island: str,
  token: str,
  host: str = "127.0.0.1",
  port: int = 0,
  devices=None,
  credentials: grpc.ServerCredentials | None = None,
):
  """Starts a worker, serving TLS with `credentials` (channel.server_credentials) when given;
  returns (grpc server, worker, bound port)."""
  worker = Worker(island, devices)
  worker.token = token
  server = grpc.server(
    concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="rpc"),
    interceptors=[auth.TokenInterceptor(token)],
    options=channel_options(),
  )
  pb_grpc.add_WorkerServicer_to_server(worker, server)
  address = f"{host}:{port}"
  if credentials is None:
    bound = server.add_insecure_port(address)
  else:
    bound = server.add_secure_port(address, credentials)
  if bound == 0:
    raise OSError(f"cannot bind {host}:{port}")
  server.start()
  return server, worker, bound
