"""`python -m pwtrain.serve --workdir=/tmp/run --port=8000`: serves a run's latest checkpoint over
HTTP (OpenAI's completions API: app.py), whatever layout trained it, and with serve.reload a newer
checkpoint as soon as one appears.

The run's config is `--config=<file>` (with `--config.<key>=<value>` overrides) when given, else
`<workdir>/config.json`, as for `pwtrain.sample`. `--config.serve.<key>=<value>` sets a serve.*
key either way (docs/config.md), and `--port`, `--host` are short for serve.port, serve.host. A
bad setting, a port in use or a missing token file is one line, before the checkpoint is read.
"""

import ast
import os
import sys

from pwtrain import platforms

platforms.prepare()  # before JAX starts: whatever it can initialise (pwtrain/platforms.py)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pwtrain import config as config_lib  # noqa: E402
from pwtrain import defaults, inference  # noqa: E402
from pwtrain.errors import ConfigError  # noqa: E402
from pwtrain.serve import server  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "The run's config: a shipped config's name or a file's path; default: <workdir>/config.json.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (checkpoints, tokenizer).")
_PORT = flags.DEFINE_integer("port", None, "serve.port: the port to listen on (0: any free one).")
_HOST = flags.DEFINE_string("host", None, "serve.host: the address to listen on.")

SERVE = "--config.serve."
_serve_overrides: list[tuple[str, str]] = []  # (key, text) of --config.serve.<key>=<text>


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO.
  print(platforms.describe(), file=sys.stderr)
  try:
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    config = inference.load_config(_CONFIG.value, workdir)
    overrides = list(_serve_overrides)
    if _PORT.value is not None:
      overrides.append(("port", str(_PORT.value)))
    if _HOST.value is not None:
      overrides.append(("host", _HOST.value))
    config = with_serve(config, overrides)
    config_lib.validate_serve(config)
    with server.listening(config) as sock:
      server.standalone(config, workdir, sock).run()
  except (ValueError, OSError) as e:
    sys.exit(f"pwtrain.serve: {e}")


def with_serve(config, overrides: list[tuple[str, str]]):
  """`config` with serve.<key> set from each (key, text), the text read as the key's type; a
  config without a serve section (a run's from before it existed) takes the defaults'."""
  if "serve" not in config:
    with config.unlocked():
      config.serve = defaults.get_config().serve
  for key, text in overrides:
    if key not in config.serve:
      raise ConfigError(f"--config.serve.{key}: no such key; serve has {', '.join(config.serve)}")
    current = config.serve[key]
    try:
      value = _parse(text, type(current))
      config.serve[key] = value
    except (TypeError, ValueError, SyntaxError) as e:
      raise ConfigError(
        f"--config.serve.{key}={text!r}: not a {type(current).__name__} ({e})"
      ) from e
  return config


def _parse(text: str, kind: type):
  if kind is bool:
    lowered = text.lower()
    if lowered not in ("true", "false", "1", "0"):
      raise ValueError("use true or false")
    return lowered in ("true", "1")
  if kind in (int, float, str):
    return kind(text)
  return ast.literal_eval(text)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with `--config=<name>` naming a shipped config (config.resolve) and
  `--config.serve.<key>=<value>` kept for `with_serve` (they apply to config.json too)."""
  rest = []
  for arg in argv:
    if arg.startswith(SERVE) and "=" in arg:
      key, _, text = arg[len(SERVE) :].partition("=")
      _serve_overrides.append((key, text))
    else:
      rest.append(arg)
  try:
    return flags.FLAGS(config_lib.resolve_argv(rest))
  except ConfigError as e:
    raise SystemExit(f"pwtrain.serve: {e}") from None


if __name__ == "__main__":
  flags.mark_flags_as_required(["workdir"])
  app.run(main, flags_parser=parse_flags)
