"""PaLM 62b (Chowdhery et al., 2022, Table 1): 64 layers, 32 heads, d_model 8192, 62.50B parameters.

Run (needs an accelerator cluster; here it only loads, validates and plans):
  python -m pwtrain.main --config=palm_62b --workdir=/tmp/palm_62b
Plan it, and compile its real step for the TPU topology on this host (the [tpu] extra):
  python -m pwtrain.main --config=palm_62b --dry_run --compile

palm_8b with the 62B shapes (d_ff = 4 d_model, head_dim 256, multi-query attention) and global
batch 1024 sequences (the end of PaLM 62B's 512 -> 1024 ramp).
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_8b", arg)
  c.model.num_layers = 64
  c.model.num_heads = 32
  c.model.d_model = 8192
  c.model.d_ff = 4 * 8192
  c.train.global_batch = 1024
  # One TPU v4 slice of 256 chips (v4-512), fully sharded. Remat "full" and 4 microbatches of
  # one sequence per chip fit 32 GiB per chip by the compiled step (--dry_run --compile:
  # ~20 GB); with "dots" XLA needs 33 GB of temporaries, more than the chip has.
  c.parallel.fsdp = 256
  c.model.remat = "full"
  c.train.num_microbatches = 4
  c.hardware.topology = "v4:4x8x8"
  c.lock()
  return c
