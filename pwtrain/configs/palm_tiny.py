"""Tiny PaLM-style model that trains on CPU in a few minutes (the default run).

Run:
  python -m pwtrain.main --config=palm_tiny --workdir=/tmp/pwtrain_tiny

Trains a 4-layer, d_model=128 decoder (byte tokenizer, vocab padded to 512) on the Python
standard library's own source text for 300 steps of 16 x 128 tokens. Expected: the loss falls
from ~6.3 (uniform over 512 ids, plus z-loss) to ~2 within the run; see docs/benchmarks.md for
measured figures. Interrupt it and run the same command again to resume from the latest checkpoint.
"""

from pwtrain import defaults


def get_config(arg=None):
  del arg
  return defaults.get_config()  # the defaults are this model (pwtrain/defaults.py)
