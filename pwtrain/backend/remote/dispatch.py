"""The controller's remote mode: compile by export, send a program as RPCs, fetch lazily.

Compiling traces the function on *stand-in* devices (the controller's own, as many as the
island has) so that shardings name a mesh of the island's shape; `jax.export` turns that into
device-independent StableHLO, and the worker compiles it for the same mesh shape over its own
devices. Dispatching a program sends, at once, each island's operations (executes and
receives, in the program's order) and the host inputs it needs; every value gets a handle
chosen here, so nothing waits for a reply before the next operation is sent. A program's outputs
are `RemoteValue`s: handles that later programs consume in place, fetched (and rebuilt as arrays
on the stand-in devices) only when `.result()` is called, e.g. for metrics or a checkpoint.
"""

import collections
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid

import grpc
import jax
import numpy as np
from jax.sharding import NamedSharding

from pwtrain import sharding as sharding_lib
from pwtrain.backend.futures import resolved
from pwtrain.backend.outline import KEPT, without_kept
from pwtrain.backend.program import Executable, Latest, Node, Transfer
from pwtrain.backend.remote import arrays, launcher, sending, timeline
from pwtrain.backend.remote import protocol_pb2 as pb
from pwtrain.backend.remote.client import WorkerClient
from pwtrain.backend.remote.published import Published
from pwtrain.backend.remote.uploads import Uploads
from pwtrain.backend.remote.values import Ref, RemoteValue, rpc_error

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RemoteExecutable:
  worker: WorkerClient
  name: str  # unique on the worker
  outputs: tuple  # per top-level output: (treedef, ShapeDtypeStructs with stand-in shardings)


class RemoteDispatcher:
  def __init__(self, cluster, trace=None):
    self.cluster = cluster
    self.trace = trace
    self._session = uuid.uuid4().hex[:8]  # several controllers may share workers
    self._names = itertools.count()
    self._trace_ids = itertools.count(1)
    self._traced: dict = {}  # trace_id -> (Event, worker) until the worker reports its span
    self.publishing = False  # Controller.start_publishing
    self._published = Published(cluster)

  # -- compilation --------------------------------------------------------------------------

  def runs_here(self, island: str) -> bool:
    del island
    return True  # the controller dispatches every island's operations

  # -- lost islands (backend/faults.py) ------------------------------------------------------

  def lose(self, island: str, cause: str) -> None:
    """A drill: kills `island`'s worker as a crash would (SIGKILL, where this process launched
    it; else a Shutdown call). Its loss is then found as any other: by the calls that fail and
    the health monitor."""
    worker = self.cluster[island].worker
    log.warning("%s: killing worker %s of island %s", cause, worker.address, island)
    if not launcher.kill_at(worker.address):
      worker.shutdown()

  def restore(self, island: str, timeout_s: float = 300.0) -> None:
    """Waits (up to `timeout_s`) until `island`'s lost worker answers again, then has it rejoin
    (WorkerClient.rejoin): every program built for the island runs there again."""
    worker = self.cluster[island].worker
    deadline = time.monotonic() + timeout_s
    while worker.lost and not (worker.answering or worker.probe(worker.timeout_s)):
      if time.monotonic() > deadline:
        raise worker.lost_error()
      time.sleep(0.2)
    self._published.forget(island)
    worker.rejoin()

  def lost(self) -> dict[str, str]:
    return {i.name: i.worker.lost for i in self.cluster.islands if i.worker.lost}

  def answering(self) -> set[str]:
    return {i.name for i in self.cluster.islands if i.worker.lost and i.worker.answering}

  def compile(
    self,
    name,
    fn,
    island,
    args,
    *,
    mesh=None,
    rules=sharding_lib.DEFAULT_RULES,
    in_shardings=None,
    out_shardings=None,
    donate_argnums=(),
  ) -> Executable:
    """Exports `fn` for `args` and has the island's worker compile it: an Executable whose
    `remote` is the worker's copy and whose `compiled` is a lazily compiled local stand-in
    (its shardings/out_info the step builders may inspect). The worker takes every input,
    read or not, as `args`' shardings say (`in_shardings` is for local compiles): a value made
    in that sharding reaches it with no copy."""
    del in_shardings
    constraints_mesh = mesh  # the model's activation constraints resolve on it while tracing

    def activate():
      if constraints_mesh is None:
        return contextlib.nullcontext()
      return sharding_lib.activate(constraints_mesh, rules)

    original = jax.jit(fn, out_shardings=without_kept(out_shardings), donate_argnums=donate_argnums)
    local = _LazyCompiled(original, args, activate)
    if any(s is KEPT for s in jax.tree.leaves(out_shardings, is_leaf=lambda x: x is None)):
      # A KEPT output (residuals, read only by a later piece of its island) takes the layout
      # the compiler chooses, which the piece that reads it is compiled for: asked of the
      # local stand-in (compiled here once), and fixed for the worker's compile.
      chosen = jax.tree.unflatten(
        jax.tree.structure(local.out_info), jax.tree.leaves(local.output_shardings)
      )
      out_shardings = jax.tree.map(
        lambda s, c: c if s is KEPT else s, out_shardings, chosen, is_leaf=lambda x: x is None
      )
    worker = self.cluster[island].worker
    # The worker sees flat lists of arrays only (export serialises no Python pytrees, and
    # nnx's int-keyed dicts could not be): inputs with explicit shardings, outputs constrained
    # to `out_shardings` inside the function; the controller keeps both tree structures.
    flat_args, in_tree = jax.tree.flatten(args)
    in_shardings = [getattr(a, "sharding", None) for a in flat_args]
    traced = {}

    def flat_fn(*leaves):
      out = fn(*jax.tree.unflatten(in_tree, leaves))
      if out_shardings is not None:
        full = jax.tree.broadcast(out_shardings, out, is_leaf=lambda x: x is None)
        out = jax.lax.with_sharding_constraint(out, full)
        traced["shardings"] = jax.tree.leaves(full)
      traced["tree"] = jax.tree.structure(out)
      return jax.tree.leaves(out)

    starts = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in args])
    donate = tuple(i for k in donate_argnums for i in range(starts[k], starts[k + 1]))
    # keep_unused: the export names the sharding of every input, read or not. An input the
    # piece does not read (a zero_bubble W's input and residuals of the input's gradient
    # alone; a first stage's tokens, in its B at stage_remat="none") would lose it: the worker
    # would take it replicated, and copy it there every run (server.py counts such copies).
    jitted = jax.jit(flat_fn, in_shardings=in_shardings, donate_argnums=donate, keep_unused=True)
    with activate():
      exported = jax.export.export(jitted, platforms=(worker.platform,))(*flat_args)
    mesh = mesh or _find_mesh((args, out_shardings))
    if mesh is None:
      raise ValueError(f"{name}: a remote piece needs a mesh (give `mesh` or shardings)")
    out_tree = traced["tree"]
    shardings = traced.get("shardings") or exported.out_shardings_jax(mesh)
    flat_out = jax.tree.unflatten(out_tree, range(out_tree.num_leaves))
    top = flat_out if isinstance(flat_out, tuple) else (flat_out,)
    outputs = []
    for out in top:
      indices, treedef = jax.tree.flatten(out)
      avals = tuple(
        jax.ShapeDtypeStruct(
          exported.out_avals[i].shape, exported.out_avals[i].dtype, sharding=shardings[i]
        )
        for i in indices
      )
      outputs.append((treedef, avals))
    unique = f"{name}#{self._session}.{next(self._names)}"
    try:
      worker.compile(
        unique,
        bytes(exported.serialize()),
        mesh,
        donate,
        [len(a) for _, a in outputs],
        traced.get("shardings"),
      )
    except grpc.RpcError as e:  # a dead worker's island is lost (WorkerLost), as in dispatch
      raise rpc_error(worker, e, frozenset({island})) from None
    remote = RemoteExecutable(worker, unique, tuple(outputs))
    return Executable(name, island, local, len(top), remote, tuple(donate_argnums))

  def wait_compiles(self) -> None:
    """Nothing to wait for here: a worker compiles in the background (its Compile returns once
    the compile is queued, remote/server.py), and an Execute there waits for its executable."""

  # -- dispatch -----------------------------------------------------------------------------

  def dispatch(self, program, inputs: dict, step: int, priority: bool = False) -> dict:
    """Sends every island's operations of `program` at once; a RemoteValue per output. A
    worker runs its ops in arrival order, but for a `priority` program's (Controller.run),
    placed ahead of the queued work not begun, at one place on every worker it touches
    (sending.py); their carried outputs (a server's caches) are not published."""
    islands = frozenset(node.island for node in program.nodes)
    for island in sorted(islands):
      if self.cluster[island].worker.lost:
        raise self.cluster[island].worker.lost_error()
    for node in program.nodes:
      if isinstance(node, Transfer) and isinstance(inputs.get(node.src), Latest):
        raise TypeError(f"{node.name}: a transfer cannot read program.Latest (nodes only)")
    # Latest inputs first: one not published yet (NotPublished) sends nothing. The islands of
    # the programs that made them are suspects of this one's failure too (rpc_error): a state
    # whose step failed with a lost pod fails its reader as that loss, until the step runs again.
    latest = {
      (ref, node.island): self._published.resolve(inputs[ref], node.island)
      for node in program.nodes
      if isinstance(node, Node)
      for ref in node.args
      if isinstance(ref, str) and isinstance(inputs[ref], Latest)
    }
    islands = islands.union(*(ref.islands for ref in latest.values()))
    prefix = f"{self._session}.{step}"
    reads: collections.Counter = collections.Counter()  # in-program reads of each value
    for node in program.nodes:
      for ref in _refs(node):
        key = (ref, node.island) if isinstance(ref, str) else ref
        if isinstance(ref, str) and isinstance(node, Transfer):
          continue  # a host input moved by a transfer is uploaded as that transfer's output
        reads[key] += 1
    outputs_refs = {ref for ref in program.outputs.values() if not isinstance(ref, str)}

    def uses(key):
      return 0 if key in outputs_refs else (reads[key] or -1)

    ops: dict = collections.defaultdict(list)
    publish = self.publishing and not priority  # a priority client's carried outputs are its own
    uploads = Uploads(prefix, islands)  # from the host: uploads.py
    values: dict = {}  # (node name, index) or (input name, island) -> _Ref

    def source(ref, node):
      if not isinstance(ref, str):
        return values[ref]
      value = inputs[ref]
      if isinstance(value, Latest):
        return latest[(ref, node.island)]
      if isinstance(value, RemoteValue):
        return value.ref
      key = (ref, node.island)
      if key not in values:
        values[key] = uploads.input(self.cluster[node.island].worker, ref, value, reads[key])
      return values[key]

    for node in program.nodes:
      worker = self.cluster[node.island].worker
      trace_id = 0
      if self.trace is not None:
        trace_id = next(self._trace_ids)
        self._traced[trace_id] = (self.trace.add(node.name, node.island, step), worker)
      if isinstance(node, Node):
        exe = node.executable.remote
        assert exe is not None and exe.worker is worker, f"{node.name}: not compiled for its island"
        args = []
        for ref in node.args:
          src = source(ref, node)
          assert src.worker is worker, f"{node.name} reads {ref} from another island"
          args.append(src.handle)
        outs = []
        for i, (treedef, avals) in enumerate(exe.outputs):
          handle = f"{prefix}/{node.name}/{i}"
          outs.append(pb.Output(handle=handle, uses=uses((node.name, i))))
          values[(node.name, i)] = Ref(worker, handle, treedef, avals, islands)
        op = pb.Execute(executable=exe.name, args=args, outputs=outs)
        publishes = self._published.publishes(program, node) if publish else ()
        ops[worker].append(
          pb.Op(name=node.name, execute=op, trace_id=trace_id, publishes=publishes)
        )
        continue
      assert isinstance(node, Transfer)
      key = (node.name, 0)
      if isinstance(node.src, str) and not isinstance(inputs[node.src], RemoteValue):
        # From the host: uploaded straight onto the island, already placed.
        value = inputs[node.src]
        n = len(jax.tree.leaves(value))
        shardings = _shardings(node.sharding, n)
        values[key] = uploads.transfer(worker, key[0], value, shardings, uses(key))
        if trace_id:  # no worker op: the upload's own span, on the controller's clock
          event, _ = self._traced.pop(trace_id)
          event.launch = event.dispatch
          done = lambda _, e=event: setattr(e, "done", self.trace.now())  # noqa: E731
          uploads.calls[-1][1].add_done_callback(done)
        continue
      src = source(node.src, node)
      shardings = _shardings(node.sharding, len(src.avals))
      handle = f"{prefix}/{node.name}/0"
      op = pb.Receive(
        source="" if src.worker is worker else src.worker.address,
        handle=src.handle,
        output=pb.Output(handle=handle, uses=uses(key)),
        shardings=[arrays.sharding_to_proto(s) for s in shardings],
      )
      ops[worker].append(pb.Op(name=node.name, receive=op, trace_id=trace_id))
      avals = tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(src.avals, shardings, strict=True)
      )
      values[key] = Ref(worker, handle, src.treedef, avals, islands)

    sending.send(ops, uploads.start(), step, priority, islands, self.cluster)  # sending.py
    wrapped: dict = {}
    out = {}
    for name, ref in program.outputs.items():
      if isinstance(ref, str):
        out[name] = inputs[ref]
      else:
        if ref not in wrapped:
          wrapped[ref] = RemoteValue(values[ref])
        out[name] = wrapped[ref]
    if publish:
      self._published.sent(program, out)
    return out

  def publish(self, island: str, name: str, value, step: int):
    """Publishes `value` under `name` on `island`, after every op sent so far (published.py);
    a resolved future."""
    del step
    self._published.put(island, name, value)
    return resolved(None)

  def collect_trace(self, wait_s: float = 10.0) -> None:
    """Fills the trace's launch/done times of the traced nodes from the workers' timelines
    (timeline.py); waits up to `wait_s` for nodes still running."""
    if self.trace is not None:
      timeline.collect(self.trace, self._traced, self.cluster.islands, wait_s)

  def close(self):
    try:
      self.collect_trace()
    except grpc.RpcError:
      pass  # a trace is not worth failing the shutdown for
    for island in self.cluster.islands:
      if island.worker.lost or island.worker.closed:
        continue
      try:
        island.worker.flush_releases()
      except grpc.RpcError:
        pass  # a lost worker holds nothing worth releasing


class _LazyCompiled:
  """The local compile of a remote executable, done only if something inspects it (the pipeline
  reads input/output shardings of a few pieces)."""

  def __init__(self, jitted, args, activate):
    self._make = lambda: _lower(jitted, args, activate).compile()
    self._compiled = None

  def __getattr__(self, name):
    if name.startswith("_"):
      raise AttributeError(name)
    if self._compiled is None:
      self._compiled = self._make()
    return getattr(self._compiled, name)


def _lower(jitted, args, activate):
  with activate():
    return jitted.lower(*args)


def _find_mesh(tree):
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", leaf)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def _shardings(sharding, n: int) -> list:
  leaves = [sharding] if isinstance(sharding, jax.sharding.Sharding) else jax.tree.leaves(sharding)
  if len(leaves) == 1:
    leaves = leaves * n
  assert len(leaves) == n, f"{len(leaves)} shardings for {n} arrays"
  for s in leaves:
    if not isinstance(s, NamedSharding):
      raise TypeError(f"remote transfers need NamedShardings; got {type(s).__name__}")
  return leaves


def _refs(node):
  return node.args if isinstance(node, Node) else (node.src,)
