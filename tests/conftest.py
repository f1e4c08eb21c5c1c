"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache per test session, inherited by the processes tests start (main runs,
# remote workers): many tests compile the same tiny programs (every train.run of the same small
# config, a worker's copy of a controller's program). A fresh directory each session, so nothing
# carries over between runs and every program is still compiled at least once.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="pwtrain_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_config(name="palm_tiny", arg=None):
  """Loads configs/<name>.py's get_config(arg), as `--config=configs/<name>.py` would."""
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.fixture
def tiny_config():
  return load_config("palm_tiny")


def tiny_test_config(**overrides):
  """An even smaller model than palm_tiny, for fast compiles; overrides are 'section.key'."""
  c = load_config("palm_tiny")
  c.model.num_layers = 2
  c.model.d_model = 64
  c.model.num_heads = 8
  c.model.head_dim = 8
  c.model.d_ff = 128
  c.data.seq_len = 32
  c.train.global_batch = 16
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


def random_batches(config, num, seed=0):
  import numpy as np

  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    tokens = rng.integers(1, 258, size=(config.train.global_batch, config.data.seq_len + 1))
    tokens[:, -3:] = np.where(rng.random((tokens.shape[0], 3)) < 0.3, 0, tokens[:, -3:])  # pads
    tokens = tokens.astype(np.int32)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  return out


def run_program(config, batches, devices=None):
  """Builds the compiled step for `config` on `devices` and runs it on `batches`.

  Returns (step program, list of host metrics, final host state of every cell).
  """
  import jax

  from pwtrain import optim
  from pwtrain.backend import Controller
  from pwtrain.parallel import build_step_program
  from pwtrain.parallel import plan as plan_lib

  cluster = plan_lib.make_cluster(config, devices=devices)
  plan = plan_lib.build(config, cluster)
  tx, schedule = optim.build(config.optim, config.train.num_steps)
  with Controller(cluster) as controller:
    program = build_step_program(config, plan, controller, tx, schedule)
    state = program.init()
    metrics = []
    for i, batch in enumerate(batches):
      out = controller.run(program.program_for(i), {**state, **program.feed(batch)})
      state = {k: out[k] for k in program.state_keys}
      metrics.append(out["metrics"])
    metrics = jax.device_get([m.result() for m in metrics])
    state = {k: v.result() if hasattr(v, "result") else v for k, v in state.items()}
  return program, metrics, jax.device_get(state)


def run_steps(config, batches, devices=None):
  """As run_program; returns (list of host metrics, final whole-model host state)."""
  program, metrics, state = run_program(config, batches, devices)
  return metrics, program.to_checkpoint(state)


def grads_at_init(config, batch, devices=None):
  """Summed-loss gradients and stats of `batch` at the init params, on config's mesh."""
  import jax

  from pwtrain import optim
  from pwtrain import sharding as sharding_lib
  from pwtrain import step as step_lib
  from pwtrain.parallel import plan as plan_lib
  from pwtrain.parallel import spmd

  cluster = plan_lib.make_cluster(config, devices=devices)
  plan = plan_lib.build(config, cluster)
  mesh = cluster.islands[0].mesh(plan.mesh_shape)
  fns = step_lib.model_fns(config.model, config.moe)
  tx, _ = optim.build(config.optim, config.train.num_steps)
  init = lambda: step_lib.init_state(fns, tx, config.seed)["params"]
  abstract = jax.eval_shape(lambda: step_lib.init_state(fns, tx, config.seed))
  shardings = spmd.state_shardings(fns, mesh, abstract)["params"]
  params = jax.jit(init, out_shardings=shardings)()
  batch = jax.device_put(batch, sharding_lib.named_sharding(mesh, ("batch", "length")))
  grad_fn = step_lib.accumulate(
    step_lib.loss_and_grads(fns, z_loss=config.model.z_loss), config.train.num_microbatches
  )
  with sharding_lib.activate(mesh):
    return jax.device_get(jax.jit(grad_fn)(params, batch))
