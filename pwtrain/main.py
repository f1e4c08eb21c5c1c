"""Entry point: `python -m pwtrain.main --config=configs/palm_tiny.py --workdir=/tmp/run`.

Any config value can be overridden on the command line, e.g. `--config.train.num_steps=50`.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from pwtrain import train

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pwtrain", "Checkpoints, metrics and traces.")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO.
  train.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
