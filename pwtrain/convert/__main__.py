"""Hugging Face checkpoints in and out of pwtrain runs (docs/models.md):

  python -m pwtrain.convert from_hf <dir or hub id> --workdir=<run> [--config.<key>=<value> ...]
  python -m pwtrain.convert to_hf --workdir=<run> <dir> [--shard_size=5GB] [--step=<n>]
                                  [--config=<file> [--config.<key>=<value> ...]]

from_hf writes <run>/config.py, config.json, tokenizer/ and a step-0 checkpoint (importer.py);
the overrides are the run's training settings (data, optimizer, layout). to_hf writes the run's
latest checkpoint (or --step's) as config.json, safetensors, generation_config.json and the
tokenizer's files (exporter.py); its config is <run>/config.json unless --config names one. A
mistake in what is given is one line, `error: ...`, and nothing is written.
"""

import argparse
import logging
import os
import re
import sys

from pwtrain import platforms

platforms.prepare()  # before JAX starts: whatever it can initialise (pwtrain/platforms.py)

from pwtrain.errors import UserError  # noqa: E402

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30


def parse_size(text: str) -> int:
  """ "5GB", "500MB", "2GiB", "1000000" -> bytes."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, flags=re.IGNORECASE)
  if not match:
    raise UserError(f"--shard_size={text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
  return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m pwtrain.convert", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  imp = commands.add_parser("from_hf", help="a Hugging Face checkpoint -> a pwtrain run")
  imp.add_argument("source", help="a checkpoint directory, or a Hub id (owner/name)")
  imp.add_argument("--workdir", required=True)
  exp = commands.add_parser("to_hf", help="a pwtrain run's checkpoint -> a Hugging Face dir")
  exp.add_argument("out_dir")
  exp.add_argument("--workdir", required=True)
  exp.add_argument("--shard_size", default="5GB")
  exp.add_argument("--step", type=int, default=None)
  exp.add_argument("--config", default=None)
  args, rest = parser.parse_known_args(argv)
  logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every save at INFO
  print(platforms.describe(), file=sys.stderr)
  from pwtrain.convert import exporter, importer

  overrides = importer.parse_overrides(rest)
  if args.command == "from_hf":
    path = importer.from_hf(args.source, args.workdir, overrides)
    print(f"imported {args.source} into {args.workdir}: fine-tune it with")
    print(f"  python -m pwtrain.main --config={path} --workdir={os.path.abspath(args.workdir)}")
    return
  workdir = os.path.abspath(os.path.expanduser(args.workdir))
  config = _export_config(args.config, workdir, overrides)
  files = exporter.to_hf(
    config, workdir, args.out_dir, shard_size=parse_size(args.shard_size), step=args.step
  )
  print(f"exported {workdir} to {args.out_dir}: {', '.join(files)}")


def _export_config(path: str | None, workdir: str, overrides: dict):
  import ml_collections

  from pwtrain import config as config_lib
  from pwtrain import workdir as workdir_lib
  from pwtrain.errors import ConfigError

  if path is not None:
    return config_lib.load(path, overrides)
  if overrides:
    raise ConfigError("--config.<key> overrides go with --config=<file>")
  saved_path, saved = workdir_lib.saved_config(workdir)
  if saved is None:
    raise ConfigError(f"{saved_path} does not exist: pass the run's config with --config=<file>")
  return ml_collections.ConfigDict(saved)


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except UserError as e:
    sys.exit(f"error: {e}")
