"""Cross-pod exchange strategies: one class per `exchange.mode`, built once per run by `make`.

A new mode is one new module in this package with a subclass of `Exchange` (base.py lists the
hooks) that sets `mode`: every module here is imported below, and each subclass registers
itself in MODES, which config validation and `make` read.
"""

import importlib
import pkgutil

from pwtrain.errors import ConfigError
from pwtrain.parallel.exchange.base import MODES, Exchange
from pwtrain.parallel.exchange.compression import COMPRESSIONS

for _module in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["COMPRESSIONS", "MODES", "Exchange", "make", "validate"]


def validate(cfg) -> None:
  """`exchange.*` errors, each naming the key, the value and what is valid."""
  for key, valid in (("mode", tuple(sorted(MODES))), ("compression", COMPRESSIONS)):
    if cfg[key] not in valid:
      raise ConfigError(f"exchange.{key}={cfg[key]!r} is not supported; valid: {', '.join(valid)}")
  if cfg.error_feedback and cfg.compression == "none":
    raise ConfigError(
      "exchange.error_feedback=True needs exchange.compression='bf16' or 'int8' (it keeps "
      f"what compression loses); got compression={cfg.compression!r}"
    )
  for key in ("buckets", "inner_steps"):
    if cfg[key] < 1:
      raise ConfigError(f"exchange.{key}={cfg[key]} must be >= 1")
  MODES[cfg.mode].validate(cfg)


def make(config) -> Exchange:
  """The run's exchange: `exchange.mode`'s class for several pods, the no-op one for one pod."""
  if config.parallel.pods == 1:
    return Exchange(config)
  return MODES[config.exchange.mode](config)
