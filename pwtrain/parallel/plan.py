"""The plan: the one layout of a run, derived once from the config and the cluster.

It resolves `parallel.{data,fsdp,expert,tensor}` into each island's mesh shape (checking that
the model and the batch divide evenly over it), cuts each pod's model into cells (pipeline
stages, or overlapped exchange's chunks) with their layer ranges, places every cell (pod, stage)
on an island, and makes the run's `Exchange` strategy. The step builders, the trainer and the
dry run read these from the Plan; none of them works them out again.
"""

import dataclasses

import numpy as np

from pwtrain.backend.cluster import Cluster, Island
from pwtrain.backend.resources import ResourceManager
from pwtrain.errors import ConfigError
from pwtrain.models import moe as moe_lib
from pwtrain.parallel import exchange as exchange_lib
from pwtrain.parallel.stages import Stage, make_stages, num_units
from pwtrain.sharding import MESH_AXES


@dataclasses.dataclass(frozen=True)
class Plan:
  islands: tuple[Island, ...]  # pod p's stage s runs on islands[p * stages + s]
  mesh_shape: dict[str, int]  # per island: {"data": d, "fsdp": f, "expert": e, "tensor": t}
  stages: tuple[Stage, ...]  # the cells of one pod: pipeline stages (or chunks), or exchange's
  cells: dict  # (pod, stage) -> Island; every pod's cells alike
  exchange: exchange_lib.Exchange
  num_pods: int
  virtual_stages: int = 1  # interleaved schedule: chunks (stages) per island and pod

  @property
  def batch_shards(self) -> int:
    return batch_shards(self.mesh_shape)

  @property
  def num_stages(self) -> int:
    """Cells per pod (pipeline stages, or overlapped exchange's chunks)."""
    return len(self.stages)

  @property
  def single_island(self) -> bool:
    """One pod of one cell: the plain SPMD step."""
    return len(self.cells) == 1

  def mesh(self, cell: tuple):
    return self.cells[cell].mesh(self.mesh_shape)


def batch_shards(mesh_shape: dict[str, int]) -> int:
  """How many ways the batch is split: over data, fsdp and expert (sharding.DEFAULT_RULES)."""
  return mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["expert"]


def resolve_mesh_shape(parallel, num_devices: int) -> dict[str, int]:
  """Fills a -1 axis (at most one) with what is left of the island's devices."""
  shape = {axis: int(parallel[axis]) for axis in MESH_AXES}
  for axis, size in shape.items():
    if size == 0 or size < -1:
      raise ConfigError(f"parallel.{axis}={size} must be a positive size or -1 (fill)")
  fill = [a for a, s in shape.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"only one of parallel.{{data,fsdp,expert,tensor}} may be -1; got {fill}")
  fixed = int(np.prod([s for s in shape.values() if s != -1]))
  if fill:
    if num_devices % fixed:
      raise ConfigError(
        f"parallel.{fill[0]}=-1 cannot be filled: the other axes use {fixed} devices, which "
        f"does not divide the island's {num_devices}"
      )
    shape[fill[0]] = num_devices // fixed
  total = int(np.prod(list(shape.values())))
  if total != num_devices:
    raise ConfigError(
      "parallel.data * parallel.fsdp * parallel.expert * parallel.tensor = "
      f"{shape['data']} * {shape['fsdp']} * {shape['expert']} * {shape['tensor']} = {total} "
      f"must equal the {num_devices} devices of an island (set one of them to -1 to fill)"
    )
  return shape


def check_model_divisibility(config, mesh_shape: dict[str, int]) -> None:
  """Model dims split over mesh axes must divide evenly (-1 axes are skipped)."""
  m, t, f = config.model, mesh_shape["tensor"], mesh_shape["fsdp"]
  for key in ("num_heads", "d_ff", "vocab_size"):
    if t > 0 and m[key] % t:
      raise ConfigError(f"parallel.tensor={t} does not divide model.{key}={m[key]}")
  if f > 0 and m.d_model % f:
    raise ConfigError(f"parallel.fsdp={f} does not divide model.d_model={m.d_model}")
  e, moe = mesh_shape["expert"], config.moe
  if moe.num_experts == 0 and e > 1:
    raise ConfigError(
      f"parallel.expert={e} needs moe.num_experts > 0: a dense model has no experts"
    )
  if moe.num_experts and e > 0 and moe.num_experts % e:
    raise ConfigError(f"parallel.expert={e} does not divide moe.num_experts={moe.num_experts}")
  d_ff = moe_lib.expert_d_ff(m, moe) if moe.num_experts else m.d_ff
  if moe.num_experts and t > 0 and d_ff % t:
    raise ConfigError(f"parallel.tensor={t} does not divide the experts' d_ff={d_ff} (moe.d_ff)")


def check_divisibility(config, mesh_shape: dict[str, int]) -> None:
  check_model_divisibility(config, mesh_shape)
  shards = batch_shards(mesh_shape)
  micro, pods = config.train.num_microbatches, config.parallel.pods
  if config.train.global_batch % (pods * shards * micro):
    raise ConfigError(
      f"train.global_batch={config.train.global_batch} must be divisible by parallel.pods * "
      "parallel.data * parallel.fsdp * parallel.expert * train.num_microbatches = "
      f"{pods} * {shards} * {micro} = {pods * shards * micro}"
    )


def build(config, cluster: Cluster, resources: ResourceManager | None = None) -> Plan:
  """The plan for `config` on `cluster`; its islands are allocated from `resources` (a fresh
  resource manager for the cluster unless one shared with other clients is given)."""
  stages, pods = config.parallel.stages, config.parallel.pods
  for key, value in (("stages", stages), ("pods", pods)):
    if value < 1:
      raise ConfigError(f"parallel.{key}={value} must be >= 1")
  if len(cluster) != stages * pods:
    raise ConfigError(
      f"parallel.islands={len(cluster)} must equal parallel.pods * parallel.stages = "
      f"{pods} * {stages} = {pods * stages}: each stage of each pod runs on its own island"
    )
  if stages > config.model.num_layers:
    raise ConfigError(
      f"parallel.stages={stages} exceeds model.num_layers={config.model.num_layers}: every "
      "stage needs at least one layer"
    )
  exchange = exchange_lib.make(config)
  # Cells are cut from layers, or from scanned periods of MoE layers (stages.num_units); the
  # interleaved schedule cuts each pod's model into stages x virtual_stages chunks.
  virtual = config.parallel.virtual_stages if config.parallel.schedule == "interleaved" else 1
  cuts = exchange.cells_per_pod(stages, num_units(config)) * virtual
  layer_ranges = make_stages(config, cuts)  # checks parallel.stage_boundaries
  resources = resources or ResourceManager(cluster)
  islands = resources.allocate("train", stages * pods, cluster.islands[0].num_devices)
  island = islands[0]
  # The model's own divisibility is the clearer error, so it is checked before the mesh fill.
  check_model_divisibility(config, {a: int(config.parallel[a]) for a in MESH_AXES})
  mesh_shape = resolve_mesh_shape(config.parallel, island.num_devices)
  check_divisibility(config, mesh_shape)
  # A pod's cells share its stages' islands: one each, all on the pod's one island when the
  # exchange cuts a one-stage pod into chunks, or (interleaved) chunk c on island c mod stages.
  placement = {
    (p, s): islands[p * stages + (s % stages if stages > 1 else 0)]
    for p in range(pods)
    for s in range(cuts)
  }
  return Plan(
    islands=islands,
    mesh_shape=mesh_shape,
    stages=tuple(layer_ranges),
    cells=placement,
    exchange=exchange,
    num_pods=pods,
    virtual_stages=virtual,
  )


def make_cluster(config, devices=None) -> Cluster:
  """Carves the local devices into `parallel.islands` islands (embedded mode), or attaches the
  island workers at `backend.workers` (remote mode)."""
  import jax

  if config.backend.mode == "remote":
    try:
      from pwtrain.backend.remote import auth
    except ImportError as e:  # grpcio is the [remote] extra
      raise ConfigError(
        f"backend.mode='remote' needs the remote extra ({e}): pip install 'pwtrain[remote]'"
      ) from None

    token = auth.read_token(config.backend.token_file, config.backend.token_env)
    return Cluster.connect(
      config.backend.workers,
      token,
      devices,
      timeout_s=config.backend.rpc_timeout_s,
      heartbeat_s=config.fault.heartbeat_s,
      progress_timeout_s=config.fault.progress_timeout_s,
      tls_ca=config.backend.tls_ca,
      isolate_losses=config.fault.elastic,
    )
  devices = list(jax.devices() if devices is None else devices)
  sizes = island_sizes(config, len(devices))
  if sum(sizes) > len(devices):
    raise ConfigError(
      f"parallel.islands={len(sizes)} x parallel.devices_per_island={sizes[0]} needs "
      f"{sum(sizes)} devices; this machine has {len(devices)} (on CPU, simulate more with "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8)"
    )
  cluster = Cluster.local(sizes, devices=devices)
  if config.backend.mode == "distributed":
    check_placement(cluster, devices)
  return cluster


def check_placement(cluster: Cluster, devices: list) -> None:
  """Distributed mode: every process holds devices of an island, and an island either lies
  within one process or spans processes that hold no other island's devices (one SPMD mesh
  over them: multi-controller SPMD, each of them launching the island's computations on its own
  devices). JAX moves an array between islands of different processes only when no process
  holds part of both (found with islands of 3 devices on 3 processes of 2: the transfer fails)."""
  processes: dict = {}
  for d in devices:
    processes[d.process_index] = processes.get(d.process_index, 0) + 1
  sizes = [i.num_devices for i in cluster.islands]
  how = (
    f"parallel.islands={len(sizes)} of {sizes[0]} devices cannot be placed on "
    f"{len(processes)} processes of {sorted(set(processes.values()))} devices"
  )
  for island in cluster.islands:
    owners = sorted(island.processes)
    shared = [
      other.name
      for other in cluster.islands
      if other is not island and island.processes & other.processes
    ]
    if len(owners) > 1 and shared:
      raise ConfigError(
        f"{how}: {island.name} would span processes {owners}, which also hold {shared[0]}; "
        "in backend.mode='distributed' an island lies within one process or spans whole "
        f"processes of its own: make parallel.islands a multiple of the {len(processes)} "
        "processes, or the processes a multiple of parallel.islands"
      )
  idle = sorted(set(processes).difference(*(i.processes for i in cluster.islands)))
  if idle:
    raise ConfigError(
      f"{how}: process(es) {idle} would hold no island; start as many processes as the "
      "islands need (pwtrain.launch --nproc), or more islands"
    )


def island_sizes(config, num_devices: int) -> list[int]:
  """Devices of each of the `parallel.islands` islands: `parallel.devices_per_island`, or (0)
  the `num_devices` available split evenly."""
  n = config.parallel.islands
  if n < 1:
    raise ConfigError(f"parallel.islands={n} must be >= 1")
  per = config.parallel.devices_per_island or num_devices // n
  if per < 1:
    raise ConfigError(
      f"parallel.islands={n} x parallel.devices_per_island={max(per, 1)} needs {n} devices; "
      f"there are {num_devices} (on CPU, simulate more with "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8)"
    )
  return [per] * n
