"""Config checks that need no devices (each error names the key, the value and what is valid),
and loading a config: a shipped one by name (pwtrain/configs/) or a file by its path.
"""

import difflib
import os
import pathlib

from pwtrain import conditions, defaults, objectives, optim
from pwtrain.backend import distributed
from pwtrain.data.loader import check_streams
from pwtrain.data.tokenizer import TOKENIZERS
from pwtrain.errors import ConfigError
from pwtrain.models import family, layers, remat
from pwtrain.models import scan as scan_lib
from pwtrain.parallel import exchange
from pwtrain.parallel.pipeline.pieces import STAGE_REMAT
from pwtrain.parallel.pipeline.schedule import SCHEDULES

BACKENDS = ("embedded", "remote", "distributed")
DTYPES = ("float32", "bfloat16", "float16")


def _positive(config, *keys):
  for key in keys:
    value = config[key.split(".")[0]][key.split(".")[1]]
    if not isinstance(value, int) or value < 1:
      raise ConfigError(f"{key}={value!r} must be a positive integer")


def validate_moe(config) -> None:
  """moe.*: num_experts=0 (dense) ignores the rest; parallel.expert needs experts to split."""
  moe, expert = config.moe, config.parallel.expert
  if not isinstance(moe.num_experts, int) or moe.num_experts < 0:
    raise ConfigError(
      f"moe.num_experts={moe.num_experts!r} must be 0 (dense) or a positive integer"
    )
  if moe.num_experts == 0:
    if expert not in (1, -1):
      raise ConfigError(
        f"parallel.expert={expert} needs moe.num_experts > 0: a dense model has no experts to "
        "split (use parallel.data for data parallelism)"
      )
    return
  if not isinstance(moe.every, int) or moe.every < 1:
    raise ConfigError(
      f"moe.every={moe.every!r} must be a positive integer (1: every layer is MoE, 2: every "
      "second layer, ...)"
    )
  if moe.every > config.model.num_layers:
    raise ConfigError(
      f"moe.every={moe.every} exceeds model.num_layers={config.model.num_layers}: no layer "
      "would be MoE"
    )
  if not isinstance(moe.top_k, int) or not 1 <= moe.top_k <= moe.num_experts:
    raise ConfigError(
      f"moe.top_k={moe.top_k!r} must be between 1 and moe.num_experts={moe.num_experts} "
      "(1: Switch, 2: GShard)"
    )
  if not isinstance(moe.d_ff, int) or moe.d_ff < 0:
    raise ConfigError(
      f"moe.d_ff={moe.d_ff!r} must be a positive integer, or 0 for model.d_ff // moe.top_k"
    )
  if moe.d_ff == 0 and config.model.d_ff % moe.top_k:
    raise ConfigError(
      f"moe.d_ff=0 means model.d_ff // moe.top_k, but moe.top_k={moe.top_k} does not divide "
      f"model.d_ff={config.model.d_ff}; set moe.d_ff"
    )
  for key in ("capacity_factor", "eval_capacity_factor"):
    if not moe[key] > 0:
      raise ConfigError(f"moe.{key}={moe[key]!r} must be > 0")
  if not 0 <= moe.jitter < 1:
    raise ConfigError(f"moe.jitter={moe.jitter!r} must be in [0, 1) (0: no router noise)")
  for key in ("aux_loss_weight", "router_z_loss_weight"):
    if not moe[key] >= 0:
      raise ConfigError(f"moe.{key}={moe[key]!r} must be >= 0")
  if expert != -1 and (expert < 1 or moe.num_experts % expert):
    raise ConfigError(
      f"parallel.expert={expert} does not divide moe.num_experts={moe.num_experts}; valid: "
      + ", ".join(str(n) for n in range(1, moe.num_experts + 1) if moe.num_experts % n == 0)
    )


def validate(config) -> None:
  _positive(
    config,
    "model.vocab_size",
    "model.num_layers",
    "model.d_model",
    "model.num_heads",
    "model.num_kv_heads",
    "model.head_dim",
    "model.d_ff",
    "data.seq_len",
    "train.global_batch",
    "train.num_steps",
    "train.num_microbatches",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
  )
  validate_moe(config)
  family.validate(config.model)
  m = config.model
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(
      f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}"
    )
  if m.head_dim % 2:
    raise ConfigError(f"model.head_dim={m.head_dim} must be even (RoPE rotates pairs)")
  for key in ("dtype", "param_dtype"):
    if m[key] not in DTYPES:
      raise ConfigError(f"model.{key}={m[key]!r} is not supported; valid: {', '.join(DTYPES)}")
  for key, valid in (("remat", remat.REMAT), ("attention", layers.ATTENTION)):
    if m[key] not in valid:
      raise ConfigError(f"model.{key}={m[key]!r} is not supported; valid: {', '.join(valid)}")
  validate_scan(config)
  if config.optim.name not in optim.OPTIMIZERS:
    raise ConfigError(
      f"optim.name={config.optim.name!r} is not an optimizer; valid: {', '.join(optim.OPTIMIZERS)}"
    )
  if config.optim.schedule not in optim.SCHEDULES:
    raise ConfigError(
      f"optim.schedule={config.optim.schedule!r} is not a schedule; valid: "
      f"{', '.join(optim.SCHEDULES)}"
    )
  if not 0 < config.optim.decay_fraction <= 1:
    raise ConfigError(f"optim.decay_fraction={config.optim.decay_fraction!r} must be in (0, 1]")
  if config.data.tokenizer not in TOKENIZERS:
    raise ConfigError(
      f"data.tokenizer={config.data.tokenizer!r} is not a tokenizer; valid: {', '.join(TOKENIZERS)}"
    )
  check_streams(config.data.streams, config.train.global_batch)
  if config.backend.mode not in BACKENDS:
    raise ConfigError(
      f"backend.mode={config.backend.mode!r} is not a backend; valid: {', '.join(BACKENDS)}"
    )
  validate_backend(config)
  if config.parallel.schedule not in SCHEDULES:
    raise ConfigError(
      f"parallel.schedule={config.parallel.schedule!r} is not a schedule; valid: "
      f"{', '.join(SCHEDULES)}"
    )
  check_virtual_stages(config)
  if config.parallel.stage_remat not in STAGE_REMAT:
    raise ConfigError(
      f"parallel.stage_remat={config.parallel.stage_remat!r} is not supported; valid: "
      f"{', '.join(STAGE_REMAT)}"
    )
  if config.parallel.stage_remat == "none" and config.backend.mode == "remote":
    raise ConfigError(
      "parallel.stage_remat='none' is not supported with backend.mode='remote' (a remote "
      "worker's pieces have every output's sharding fixed, and a stage's residuals are laid out "
      "by the compiler); set parallel.stage_remat='full'"
    )
  exchange.validate(config.exchange)
  if config.train.global_batch % config.train.num_microbatches:
    raise ConfigError(
      f"train.num_microbatches={config.train.num_microbatches} does not divide "
      f"train.global_batch={config.train.global_batch}"
    )
  if config.train.eval_every and config.train.eval_batches < 1:
    raise ConfigError(
      f"train.eval_batches={config.train.eval_batches!r} must be >= 1 while train.eval_every="
      f"{config.train.eval_every} (set train.eval_every=0 to never evaluate)"
    )
  for key in (
    "rollback_after",
    "rollback_skip_batches",
    "max_rollbacks",
    "eval_every",
    "compile_cache_max_bytes",
  ):
    value = config.train[key]
    if not isinstance(value, int) or value < 0:
      raise ConfigError(f"train.{key}={value!r} must be a non-negative integer")
  if config.train.rollback_after and not config.train.skip_nonfinite:
    raise ConfigError(
      f"train.rollback_after={config.train.rollback_after} counts skipped non-finite steps, "
      "so it needs train.skip_nonfinite=True (or set train.rollback_after=0)"
    )
  validate_serve(config)
  objectives.validate(config)
  conditions.check(config, defaults.get_config())  # no key set where nothing reads it


def validate_serve(config) -> None:
  """serve.*: the server's settings (pwtrain/serve/), and where attached serving runs."""
  s = config.serve
  _positive(config, "serve.max_batch", "serve.prefill_chunk", "serve.queue_size")
  if not isinstance(s.max_len, int) or s.max_len < 0 or 0 < s.max_len < 2:
    raise ConfigError(f"serve.max_len={s.max_len!r} must be >= 2, or 0 for data.seq_len")
  if not isinstance(s.port, int) or not 0 <= s.port <= 65535:
    raise ConfigError(f"serve.port={s.port!r} must be a port number, 0 to 65535 (0: any free)")
  if not isinstance(s.host, str) or not s.host:
    raise ConfigError(f"serve.host={s.host!r} must be an address, e.g. '127.0.0.1'")
  if not 0 < s.share <= 1:
    raise ConfigError(f"serve.share={s.share!r} must be in (0, 1]: serving's share of an island")
  if not s.reload_poll_s > 0:
    raise ConfigError(f"serve.reload_poll_s={s.reload_poll_s!r} must be > 0 seconds")
  if s.token_file and not os.path.isfile(os.path.expanduser(s.token_file)):
    raise ConfigError(f"serve.token_file={s.token_file!r} is not a file")
  if s.enabled and config.backend.mode == "distributed":
    raise ConfigError(
      "serve.enabled=True with backend.mode='distributed': attached serving needs one "
      "controller of every island (embedded or remote mode); serve the checkpoints with "
      "python -m pwtrain.serve instead"
    )


def validate_scan(config) -> None:
  """model.scan_layers: a bool whose periods (models/scan.py) tile the model; not remote."""
  scan = config.model.scan_layers
  if not isinstance(scan, bool):
    raise ConfigError(f"model.scan_layers={scan!r} must be True or False")
  if not scan:
    return
  moe = config.moe
  if moe.num_experts and config.model.num_layers % moe.every:
    raise ConfigError(
      f"model.scan_layers=True with MoE scans periods of moe.every={moe.every} layers: "
      f"model.num_layers={config.model.num_layers} must be a multiple of {moe.every} (or set "
      "model.scan_layers=False)"
    )
  n = scan_lib.period(config.model, moe)
  if config.model.num_layers % n:
    raise ConfigError(
      f"model.scan_layers=True scans periods of {n} layers (local and global layers: "
      f"model.sliding_window_pattern={config.model.sliding_window_pattern}): "
      f"model.num_layers={config.model.num_layers} must be a multiple of {n} (or set "
      "model.scan_layers=False)"
    )
  if config.backend.mode == "remote":
    raise ConfigError(
      "model.scan_layers=True is not supported with backend.mode='remote' (checkpoints hold "
      "layers unrolled, and remote workers' arrays are not unstacked); set "
      "model.scan_layers=False"
    )


def validate_backend(config) -> None:
  """Remote islands: one worker (or one launched worker) per island, sane fault settings."""
  b, f = config.backend, config.fault
  if b.mode == "remote":
    workers = list(b.workers)
    if b.launch_workers and workers:
      raise ConfigError(
        f"backend.launch_workers=True starts its own workers; backend.workers={workers} must "
        "then be empty"
      )
    if not b.launch_workers and len(workers) != config.parallel.islands:
      raise ConfigError(
        f"backend.mode='remote' needs one worker address per island: backend.workers has "
        f"{len(workers)} ({workers}) but parallel.islands={config.parallel.islands}"
      )
    for address in workers:
      host, _, port = str(address).rpartition(":")
      if not host or not port.isdigit():
        raise ConfigError(f"backend.workers entry {address!r} is not 'host:port'")
    if b.tls_ca and not os.path.isfile(b.tls_ca):
      raise ConfigError(
        f"backend.tls_ca={b.tls_ca!r} is not a file: give the PEM certificate that verifies the "
        "workers' TLS (their CA, or a worker's self-signed certificate)"
      )
  elif list(b.workers) or b.launch_workers:
    raise ConfigError(
      f"backend.workers/backend.launch_workers are for backend.mode='remote', not {b.mode!r}"
    )
  if b.mode == "distributed":
    distributed.resolve(b)  # names a malformed backend.coordinator/num_processes/process_id
  positive = {"backend.connect_timeout_s": b.connect_timeout_s, "fault.heartbeat_s": f.heartbeat_s}
  positive["backend.rpc_timeout_s"] = b.rpc_timeout_s
  for key, value in positive.items():
    if value <= 0:
      raise ConfigError(f"{key}={value} must be > 0")
  if not isinstance(f.max_restarts, int) or f.max_restarts < 0:
    raise ConfigError(f"fault.max_restarts={f.max_restarts!r} must be an integer >= 0")
  if f.progress_timeout_s < 0:
    raise ConfigError(f"fault.progress_timeout_s={f.progress_timeout_s} must be >= 0 (0: never)")


CONFIGS_PACKAGE = "pwtrain.configs"  # the configs that ship with pwtrain, one file each


def shipped() -> dict[str, pathlib.Path]:
  """{name: path} of the shipped configs (pwtrain/configs/<name>.py), sorted by name."""
  import importlib.resources

  folder = pathlib.Path(str(importlib.resources.files(CONFIGS_PACKAGE)))
  files = sorted(f for f in folder.glob("*.py") if f.name != "__init__.py")
  return {f.stem: f for f in files}


def resolve(spec) -> str:
  """A `--config` value as a config file's path: `spec` is `name` or `path`, optionally with
  `:arg`. An existing file is used as it is; a name (no "/", no ".py") names a shipped config
  (`palm_tiny` is pwtrain/configs/palm_tiny.py); anything else is kept as the path it is (load
  then says that it does not exist). An unknown name is a ConfigError listing the shipped ones."""
  file, colon, arg = str(spec).partition(":")
  if os.path.isfile(os.path.expanduser(file)) or "/" in file or file.endswith(".py"):
    return str(spec)
  configs = shipped()
  if file not in configs:
    close = difflib.get_close_matches(file, configs, n=1)
    hint = f"; did you mean {close[0]}?" if close else "."
    raise ConfigError(
      f"--config={file} names no shipped config and no file{hint} The shipped configs: "
      f"{', '.join(configs)}; or give a config file's path"
    )
  return f"{configs[file]}{colon}{arg}"


def resolve_argv(argv: list[str]) -> list[str]:
  """`argv` with its `--config=<spec>` (or `--config <spec>`) flag's spec `resolve`d: what
  `pwtrain.main` and `pwtrain.sample` parse, so that ml_collections' config_flags, which reads
  files only, is given a file."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith("--config="):
      out[i] = "--config=" + resolve(arg.removeprefix("--config="))
    elif arg == "--config" and i + 1 < len(out):
      out[i + 1] = resolve(out[i + 1])
  return out


def load(path, overrides: dict | None = None):
  """The config that `path`'s `get_config(arg)` returns, with `overrides` applied.

  `path` is a shipped config's name or a config file (`resolve`), optionally followed by `:arg`
  as with `--config=path:arg` (config_flags): `arg` (a string) is passed to `get_config`, else
  None. `overrides` maps dotted keys to values,
  e.g. {"parallel.data": 8, "seed": 1}; each key must already exist in the config (a ValueError
  names the first that does not) and is set as `--config.<key>=<value>` would set it. The result is
  locked or not as `get_config` left it.
  """
  import importlib.util

  file, _, arg = resolve(path).partition(":")
  file = pathlib.Path(file).expanduser().resolve()
  if not file.is_file():
    raise ConfigError(f"config file {str(file)!r} does not exist")
  spec = importlib.util.spec_from_file_location(f"pwtrain_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  for key, value in (overrides or {}).items():
    *parents, name = key.split(".")
    node = config
    for parent in parents:
      if parent not in node or not hasattr(node[parent], "keys"):
        raise ConfigError(f"config override {key!r}: {file.name} has no section {parent!r}")
      node = node[parent]
    if name not in node:
      raise ConfigError(f"config override {key!r}: {file.name} has no key {key!r}")
    try:
      node[name] = value
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config override {key}={value!r}: {e}") from e
  return config


def base_config(config_file: str, name: str, arg=None):
  """The config `name` from the same directory as `config_file`, unlocked, to start from.

  Lets `palm_8b` begin from `palm_tiny` however the file was loaded (by name or by path).
  """
  path = pathlib.Path(config_file).resolve().with_name(f"{name}.py")
  config = load(path if arg is None else f"{path}:{arg}")
  config.unlock()
  return config


def check_virtual_stages(config) -> None:
  """parallel.virtual_stages against the schedule: the interleaved schedule cuts the model into
  S·v equal chunks and sends microbatches round the S islands in groups of S."""
  p, v = config.parallel, config.parallel.virtual_stages
  if p.schedule != "interleaved":
    if v != 1:
      raise ConfigError(
        f"parallel.virtual_stages={v} is for parallel.schedule='interleaved' (now "
        f"{p.schedule!r}): set the schedule, or parallel.virtual_stages=1"
      )
    return
  chunks, m = p.stages * v, config.train.num_microbatches
  if p.stages < 2 or v < 1:
    raise ConfigError(
      f"parallel.schedule='interleaved' needs parallel.stages >= 2 and parallel.virtual_stages "
      f">= 1; got {p.stages} and {v}"
    )
  if config.model.num_layers % chunks:
    raise ConfigError(
      f"parallel.schedule='interleaved' cuts model.num_layers={config.model.num_layers} into "
      f"parallel.stages x parallel.virtual_stages = {p.stages} x {v} = {chunks} equal chunks: "
      "choose stages and virtual stages whose product divides the layers"
    )
  if m % p.stages:
    raise ConfigError(
      f"parallel.schedule='interleaved' sends microbatches round the islands in groups of "
      f"parallel.stages={p.stages}: train.num_microbatches={m} must be a multiple of it"
    )
