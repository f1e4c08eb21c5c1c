"""Arrays on the wire: raw bytes with dtype/shape/sharding headers, in bounded chunks.

A value is a flat list of arrays (a pytree's leaves; the controller keeps the tree structure).
Nothing here unpickles: dtypes are names checked against a fixed set, shapes are integers.
"""

from collections.abc import Iterable, Iterator

import numpy as np

from pwtrain.backend.remote import protocol_pb2 as pb

CHUNK_BYTES = 1 << 20
# gRPC's per-message limit on both ends: a chunk plus its header, with room to spare.
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES

_DTYPES = {
  name: np.dtype(name)
  for name in (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
  )
}


def _dtype(name: str) -> np.dtype:
  if name in _DTYPES:
    return _DTYPES[name]
  import ml_dtypes  # bfloat16 and friends; a jax dependency

  if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
    return np.dtype(getattr(ml_dtypes, name))
  raise ValueError(f"unsupported dtype on the wire: {name!r}")


def sharding_to_proto(sharding) -> pb.Sharding:
  """A NamedSharding -> its mesh's axis names and sizes and its partition spec."""
  mesh = sharding.mesh
  spec = []
  for entry in sharding.spec:
    if entry is None:
      spec.append("")
    elif isinstance(entry, str):
      spec.append(entry)
    else:
      spec.append(",".join(entry))
  return pb.Sharding(
    mesh_axes=list(mesh.axis_names), mesh_shape=[int(s) for s in mesh.devices.shape], spec=spec
  )


def sharding_from_proto(proto: pb.Sharding, devices):
  """The same NamedSharding over this process's `devices` (a mesh of the same shape)."""
  from jax.sharding import NamedSharding, PartitionSpec

  mesh = make_mesh(proto.mesh_axes, proto.mesh_shape, devices)
  spec = [None if e == "" else (tuple(e.split(",")) if "," in e else e) for e in proto.spec]
  return NamedSharding(mesh, PartitionSpec(*spec))


_MESHES: dict = {}


def make_mesh(axes, shape, devices):
  """One Mesh object per (axes, shape), so that shardings built from messages compare equal."""
  from jax.sharding import Mesh

  key = (tuple(axes), tuple(int(s) for s in shape))
  if key not in _MESHES:
    size = int(np.prod(key[1]))
    if size > len(devices):
      raise ValueError(
        f"a mesh of shape {key[1]} needs {size} devices; this worker has {len(devices)}"
      )
    _MESHES[key] = Mesh(np.asarray(devices[:size], dtype=object).reshape(key[1]), key[0])
  return _MESHES[key]


def to_chunks(
  handle: str, leaves: list, shardings=None, uses: int = 0, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.Chunk]:
  """Chunks of a value: `leaves` as host arrays, each with an optional sharding to restore."""
  yield pb.Chunk(handle=handle, num_leaves=len(leaves), uses=uses, leaf=-1)
  for i, leaf in enumerate(leaves):
    array = np.asarray(leaf, order="C")  # (ascontiguousarray would make scalars 1-D)
    header = pb.ArrayHeader(
      dtype=array.dtype.name, shape=list(array.shape), nbytes=array.nbytes, has_sharding=False
    )
    if shardings is not None and shardings[i] is not None:
      header.has_sharding = True
      header.sharding.CopyFrom(sharding_to_proto(shardings[i]))
    data = memoryview(array.reshape(-1).view(np.uint8))
    yield pb.Chunk(leaf=i, header=header, data=bytes(data[:chunk_bytes]))
    for start in range(chunk_bytes, array.nbytes, chunk_bytes):
      yield pb.Chunk(leaf=i, data=bytes(data[start : start + chunk_bytes]))


def from_chunks(chunks: Iterable[pb.Chunk]):
  """(first chunk, [(host array, sharding proto or None)]) of a chunk stream."""
  it = iter(chunks)
  first = next(it)
  if first.leaf != -1:
    raise ValueError("a value's first chunk must name it")
  leaves: list = [None] * first.num_leaves
  buffers: list = [None] * first.num_leaves
  filled = [0] * first.num_leaves
  for chunk in it:
    i = chunk.leaf
    if not 0 <= i < first.num_leaves:
      raise ValueError(f"chunk for array {i} of a value of {first.num_leaves}")
    if chunk.HasField("header"):
      h = chunk.header
      dtype = _dtype(h.dtype)
      shape = tuple(int(s) for s in h.shape)
      if any(s < 0 for s in shape) or int(np.prod(shape)) * dtype.itemsize != h.nbytes:
        raise ValueError(f"array {i}: header {dtype}{list(shape)} does not match {h.nbytes} bytes")
      buffers[i] = bytearray(h.nbytes)
      leaves[i] = (dtype, shape, h.sharding if h.has_sharding else None)
    if buffers[i] is None:
      raise ValueError(f"array {i}: data before its header")
    end = filled[i] + len(chunk.data)
    if end > len(buffers[i]):
      raise ValueError(f"array {i}: more bytes than its header announced")
    buffers[i][filled[i] : end] = chunk.data
    filled[i] = end
  out = []
  for i, meta in enumerate(leaves):
    if meta is None or filled[i] != len(buffers[i]):
      raise ValueError(f"array {i}: incomplete ({filled[i]} bytes received)")
    dtype, shape, sharding = meta
    out.append((np.frombuffer(buffers[i], dtype=dtype).reshape(shape), sharding))
  return first, out
