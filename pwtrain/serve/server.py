"""Running the server: the socket bound before anything else starts (a port in use is one line,
not a failure after compiling), the engine behind the HTTP app, and uvicorn serving it, on a
thread of a training run (`attached`) or in the foreground of `python -m pwtrain.serve`
(`Server.run`).
"""

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time

from pwtrain import inference
from pwtrain.errors import ConfigError
from pwtrain.serve.engine import Engine
from pwtrain.serve.metrics import Stats
from pwtrain.serve.requests import Limits
from pwtrain.serve.weights import CheckpointWeights, LiveWeights

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # compiling the pieces of a large model


@dataclasses.dataclass(frozen=True)
class Settings:
  """serve.* with serve.max_len resolved (0: data.seq_len)."""

  max_batch: int
  max_len: int
  prefill_chunk: int
  queue_size: int


def settings(config) -> Settings:
  s = config.serve
  max_len = s.max_len or config.data.seq_len
  return Settings(s.max_batch, max_len, s.prefill_chunk, s.queue_size)


@contextlib.contextmanager
def listening(config, host: str | None = None, port: int | None = None):
  """A socket bound to serve.host:serve.port (or `host`, `port`), closed on exit; a ConfigError
  naming the keys when it cannot be bound."""
  host = config.serve.host if host is None else host
  port = config.serve.port if port is None else port
  try:
    sock = socket.create_server((host, port), family=_family(host))
  except OSError as e:
    raise ConfigError(
      f"serve.host={host!r} serve.port={port}: cannot listen there ({e.strerror or e}); choose "
      "another port (0: any free one) or host"
    ) from e
  try:
    yield sock
  finally:
    sock.close()


def _family(host: str) -> int:
  return socket.AF_INET6 if ":" in host else socket.AF_INET


def read_token(path: str) -> str:
  """serve.token_file's token ("" for no file); a ConfigError if it is unreadable or empty."""
  if not path:
    return ""
  try:
    with open(os.path.expanduser(path)) as f:
      token = f.read().strip()
  except OSError as e:
    raise ConfigError(f"serve.token_file={path!r}: {e.strerror or e}") from e
  if not token:
    raise ConfigError(f"serve.token_file={path!r} is empty: write the clients' token in it")
  return token


class Server:
  """uvicorn serving `app` on `sock`, over `engine` (stopped with it) and its weights `source`
  (closed with it)."""

  def __init__(self, engine: Engine, source, app, sock: socket.socket):
    import uvicorn  # the [serve] extra

    self.engine = engine
    self.source = source
    self.sock = sock
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    self._uvicorn = uvicorn.Server(config)
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    host, port = self.sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"

  def start(self) -> "Server":
    """Serves on a thread; returns once the engine serves (its pieces compiled, the weights
    there), or has its pieces and awaits the weights (a remote run's first step publishes
    them: /health says 503 "starting" until then), and the server accepts connections."""
    self._wait_for_engine()
    self._thread = threading.Thread(
      target=self._uvicorn.run, kwargs={"sockets": [self.sock]}, name="serve-http", daemon=True
    )
    self._thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not self._uvicorn.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the HTTP server did not start on {self.url}")
      time.sleep(0.01)
    log.info("serving the model at %s/v1 (OpenAI completions)", self.url)
    return self

  def run(self) -> None:
    """Serves in the foreground until interrupted (Ctrl-C, SIGTERM), then stops and returns
    (uvicorn stops on either signal, then raises it again for the handler before it: here a
    KeyboardInterrupt, which ends the serving, not the process)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
      self._wait_for_engine()
      log.warning("serving the model at %s/v1 (OpenAI completions); Ctrl-C stops", self.url)
      self._uvicorn.run(sockets=[self.sock])
    except KeyboardInterrupt:
      log.warning("stopping")
    finally:
      self.stop()
      signal.signal(signal.SIGTERM, previous)

  def _wait_for_engine(self) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ((status := self.engine.status())["serving"] or status["awaiting_weights"]):
      if self.engine.error:
        raise RuntimeError(f"the serving engine failed to start: {self.engine.error}")
      if time.monotonic() > deadline:
        raise RuntimeError(f"the serving engine was not ready after {START_TIMEOUT_S:.0f} s")
      time.sleep(0.01)

  def stop(self) -> None:
    """Stops the engine (what it serves ends with an error: 503, or a streamed error), then the
    HTTP server and the weights' source."""
    self.engine.stop()
    self._uvicorn.should_exit = True
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self.source.close()


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def _server(config, source, controller, tokenizer, sock, workdir: str) -> Server:
  from pwtrain.serve import chat  # jinja2: the [serve] extra
  from pwtrain.serve.app import make_app  # fastapi: the [serve] extra

  serving = settings(config)
  stats = Stats()
  engine = Engine(source, controller, tokenizer, serving, stats)
  local = not controller.cluster.remote  # remote: the islands' time and memory are the workers'
  app = make_app(
    engine,
    tokenizer,
    Limits(serving.max_len, serving.max_batch),
    model=os.path.basename(workdir),
    token=read_token(config.serve.token_file),
    island_time=controller.island_time if local else None,
    device_bytes=device_bytes if local else None,
    chat_template=chat.load(config, workdir),
  )
  return Server(engine, source, app, sock)


def device_bytes(arrays=None) -> int:
  """The device memory of `arrays` (a tree of them; None: this process's live arrays, training
  state, weights and caches): each buffer on each device once (a replicated array counts once
  per device holding it; an array and the single-device views of its shards share their
  buffers)."""
  import jax

  buffers = {}
  arrays = jax.live_arrays() if arrays is None else jax.tree.leaves(arrays)
  for array in arrays:
    try:
      shards = [
        ((s.device.id, s.data.unsafe_buffer_pointer()), s.data.nbytes)
        for s in array.addressable_shards
      ]
    except RuntimeError:  # deleted (donated by a step, or with a lost island) as it was read
      continue
    buffers.update(shards)
  return sum(buffers.values())


@contextlib.contextmanager
def attached(config, controller, current, state: dict, workdir: str, sock, tokenizer=None):
  """Serves the training run's live parameters (weights.LiveWeights) while the block runs:
  `current()` the harness that runs the steps, `state` the state the run starts from, `sock`
  from `listening`, `tokenizer` the run's (None: inference.run_tokenizer's). Serving programs
  share the islands within serve.share of their time (remote workers place them ahead of their
  queued steps, without a share: config.validate_serve)."""
  if not controller.cluster.remote:
    controller.set_priority_share(config.serve.share)
  source = LiveWeights(config, controller, current)
  source.start(state)
  tokenizer = tokenizer or inference.run_tokenizer(config, workdir)
  server = _server(config, source, controller, tokenizer, sock, workdir)
  server.start()
  try:
    yield server
  finally:
    server.stop()


def standalone(config, workdir: str, sock) -> Server:
  """A server of the run in `workdir` from its latest checkpoint (weights.CheckpointWeights),
  reloading newer ones with serve.reload."""
  read_token(config.serve.token_file)  # before the checkpoint is read: one line
  tokenizer = inference.run_tokenizer(config, workdir)
  source = CheckpointWeights(
    config, workdir, reload=config.serve.reload, poll_s=config.serve.reload_poll_s
  )
  try:
    return _server(config, source, source.controller, tokenizer, sock, workdir)
  except BaseException:
    source.close()
    raise
