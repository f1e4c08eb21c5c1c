"""What the tests share: the repository, the parity tolerance, small configs, random batches,
the step run every way the parity tests compare, and a standalone server with its streamed
responses. conftest.py sets up the environment (8
simulated CPU devices) before any of this imports JAX.
"""

import contextlib
import json
import pathlib
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# Parity tolerance (test_parity's docstring): every layout is fp32 and differs from the 1-device
# run only in the order of reductions across shards, ~1e-6 of each tensor's largest entry.
TOL = 1e-5
# SGD with momentum: its update is linear in the gradient, so parameters and optimizer state can
# be compared across layouts after a few steps (Adafactor's cannot, see test_parity).
SGD = {"optim.name": "sgd", "optim.lr": 0.5, "optim.warmup_steps": 1}
# Two elastic pods of one island of 2 devices each, the data split over both, exchanging
# gradients in sync: runs where a pod is lost and rejoins (test_silent_faults, test_wedge_drill).
ELASTIC_PODS = {
  **SGD,
  "parallel.islands": 2,
  "parallel.devices_per_island": 2,
  "parallel.pods": 2,
  "parallel.data": -1,
  "exchange.mode": "sync",
  "train.global_batch": 8,
  "train.num_steps": 10,
  "train.checkpoint_every": 100,
  "fault.elastic": True,
}
TINY = {  # an even smaller model than palm_tiny, for fast compiles
  "model.num_layers": 2,
  "model.d_model": 64,
  "model.num_heads": 8,
  "model.head_dim": 8,
  "model.d_ff": 128,
  "data.seq_len": 32,
  "train.global_batch": 16,
}


def metrics_rows(workdir, *, running: bool = False) -> list[dict]:
  """The rows of `workdir`/metrics.jsonl. Of a finished run, every line (a torn line fails the
  read). `running`: of a run still writing it, the rows written whole so far (its process may
  be mid-line), [] before the file exists."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  if running and not path.exists():
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if not running or line.endswith("\n")]


class RowTimes:
  """When each training row of `workdir`/metrics.jsonl appeared (`at`: step -> time.time()),
  watched from a thread every `poll_s` until `stop`."""

  def __init__(self, workdir, poll_s: float = 0.05):
    self.workdir, self.at, self.poll_s = workdir, {}, poll_s
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()

  def _watch(self):
    while not self._stop.wait(self.poll_s):
      for row in metrics_rows(self.workdir, running=True):
        if "loss" in row:
          self.at.setdefault(row["step"], time.time())

  def stop(self):
    self._stop.set()
    self._thread.join(5)


def step_losses(workdir, *, running: bool = False) -> dict[int, float]:
  """{step: loss} of the training rows in `workdir`/metrics.jsonl (`running`: see
  metrics_rows)."""
  return {r["step"]: r["loss"] for r in metrics_rows(workdir, running=running) if "loss" in r}


def load_config(name="palm_tiny", overrides=None):
  """The shipped config `name`'s get_config(), as `--config=<name>` would load it, with
  `overrides` {"section.key": value} applied (pwtrain.config.load)."""
  from pwtrain import config as config_lib

  return config_lib.load(name, overrides)


def tiny_test_config(**overrides):
  """palm_tiny shrunk to TINY, for fast compiles; overrides are {"section.key": value}."""
  return load_config("palm_tiny", {**TINY, **overrides})


def small_config(**overrides):
  """tiny_test_config for train.run: 12 steps of the built-in corpus (40 files), logged every 2,
  no evaluation (tests of evaluation turn it on)."""
  return tiny_test_config(
    **{
      "data.max_files": 40,
      "train.log_every": 2,
      "train.num_steps": 12,
      "train.eval_every": 0,
      **overrides,
    }
  )


def assert_close(actual, expected, what, tol=TOL):
  """max|actual - expected| <= tol * max|expected|, in float64."""
  import numpy as np

  a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert a.shape == e.shape, what
  err, scale = np.max(np.abs(a - e), initial=0.0), np.max(np.abs(e), initial=0.0)
  assert err <= tol * max(scale, 1e-30), f"{what}: max|diff|={err:.3g}, max|expected|={scale:.3g}"


def assert_trees_close(actual, expected, what, tol=TOL):
  """assert_close leaf by leaf; the two trees must have the same structure."""
  import jax

  flat_a, tree_a = jax.tree.flatten_with_path(actual)
  flat_e, tree_e = jax.tree.flatten_with_path(expected)
  assert tree_a == tree_e, what
  for (path, a), (_, e) in zip(flat_a, flat_e, strict=True):
    assert_close(a, e, f"{what}{jax.tree_util.keystr(path)}", tol)


def random_batches(config, num, seed=0):
  import numpy as np

  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    tokens = rng.integers(1, 258, size=(config.train.global_batch, config.data.seq_len + 1))
    tokens[:, -3:] = np.where(rng.random((tokens.shape[0], 3)) < 0.3, 0, tokens[:, -3:])  # pads
    tokens = tokens.astype(np.int32)
    # Positions no document filled: as the loader marks them, a target of -1 (no loss).
    targets = np.where(tokens[:, 1:] == 0, np.int32(-1), tokens[:, 1:])
    out.append({"inputs": tokens[:, :-1], "targets": targets})
  return out


def run_program(config, batches, devices=None):
  """Builds the compiled step for `config` on `devices` and runs it on `batches`.

  Returns (step program, list of host metrics, final host state of every cell).
  """
  import jax

  from pwtrain.harness import Harness

  with Harness.build(config, devices) as harness:
    metrics, state = step_through(harness, harness.init(), batches)
  return harness.step_program, metrics, jax.device_get(state)


def step_through(harness, state, batches):
  """(host metrics of each step, the final state's values) of `harness` stepping `state` through
  `batches`."""
  import jax

  metrics = []
  for i, batch in enumerate(batches):
    out = harness.step(state, batch, i)
    state = out.state
    metrics.append(out.metrics)
  metrics = jax.device_get([m.result() for m in metrics])
  return metrics, {k: v.result() if hasattr(v, "result") else v for k, v in state.items()}


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


class Gated:
  """The run's training batches, where reading batch i (0-based) first waits, up to 300 s,
  until `gates[i]()` holds (what the test needs served by then; the training steps are the same
  whenever they run)."""

  def __init__(self, inner, gates: dict):
    self.inner, self.gates, self.i = inner, gates, 0

  def __iter__(self):
    return self

  def __next__(self):
    gate = self.gates.get(self.i, lambda: True)
    deadline = time.monotonic() + 300
    while not gate() and time.monotonic() < deadline:
      time.sleep(0.05)
    self.i += 1
    return next(self.inner)

  def __getattr__(self, name):  # get_state, set_state, ...
    return getattr(self.inner, name)


@contextlib.contextmanager
def standalone_server(config, workdir, token_dir, token: str, **serve_settings):
  """pwtrain.serve's standalone server of `workdir`'s checkpoint, as `config` says with
  `serve_settings` {serve key: value} set, on 127.0.0.1 at a port the system picks
  (serve.port=0), not reloading, and answering requests with `token`, written to the token file
  `token_dir`/token. Yields the running server (its `url`); stops it on exit."""
  from pwtrain import serve

  token_file = pathlib.Path(token_dir) / "token"
  token_file.write_text(token + "\n")
  with config.unlocked():
    config.serve.update(port=0, reload=False, token_file=str(token_file), **serve_settings)
  with serve.listening(config) as sock:
    running = serve.standalone(config, str(workdir), sock).start()
    try:
      yield running
    finally:
      running.stop()


def openai_client(server, token: str):
  """OpenAI's client of `server` (standalone_server's), with `token`; no retries."""
  import openai

  return openai.OpenAI(base_url=f"{server.url}/v1", api_key=token, max_retries=0, timeout=60)


class StreamError(RuntimeError):
  """An error chunk in a streamed response; its message is the server's."""


def streamed_chunks(http, body: dict, path: str = "/v1/completions"):
  """The JSON chunks, in order, of `body` POSTed to `path` as a stream (`"stream": true`) on
  `http` (an httpx.Client with the server's base_url): each `data: {...}` line, the closing
  `data: [DONE]` left out. Raises httpx.HTTPStatusError on an error status and StreamError on
  an error chunk."""
  with http.stream("POST", path, json={**body, "stream": True}) as response:
    response.raise_for_status()
    for line in response.iter_lines():
      if line.startswith("data: {"):
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
          raise StreamError(chunk["error"]["message"])
        yield chunk


def weights_step(response: dict) -> int:
  """The training step of the weights a response or a streamed chunk came from (its
  system_fingerprint, "pwtrain-step-<n>")."""
  return int(response["system_fingerprint"].removeprefix("pwtrain-step-"))
