"""Gemma 2 2B (Gemma Team, 2024): 26 layers, d_model 2304, 8 query heads of 256 sharing 4
key/value heads, GeGLU of 9216, a 256,000-token vocabulary shared with the output layer:
2.61B parameters. Every second layer attends locally (a 4096-token window), the others
globally; attention logits are soft-capped at 50 and the output logits at 30, and each block
norms its attention and MLP outputs too (post-norms).

Plan it for its cluster (here it only loads, validates and plans), and compile its real step for
the TPU topology on this host (the [tpu] extra):
  python -m pwtrain.main --config=gemma2_2b --dry_run
  python -m pwtrain.main --config=gemma2_2b --dry_run --compile

Its weights come from a Hugging Face directory (docs/models.md): `python -m pwtrain.convert
from_hf <dir> --workdir=<run>` writes that run's own config (these keys, read from the
directory's config.json) and a step-0 checkpoint, with the tokenizer. This file is the
architecture with 8192-token sequences, AdamW, on a TPU v4 slice of 16 chips (fsdp=16).
"""

import ml_collections

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.model.family = "gemma"
  c.model.num_layers = 26
  c.model.d_model = 2304
  c.model.num_heads = 8
  c.model.num_kv_heads = 4
  c.model.head_dim = 256
  c.model.d_ff = 9216
  c.model.vocab_size = 256_000
  c.model.query_pre_attn_scalar = 256
  c.model.sliding_window = 4096
  c.model.sliding_window_pattern = 2  # layers 0, 2, ... local; 1, 3, ... global
  c.model.attn_softcap = 50.0
  c.model.final_softcap = 30.0
  c.model.post_norms = True
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True  # periods of a local and a global layer
  c.model.remat = "full"

  c.data.dataset = "c4"  # any prepared TFDS text dataset
  c.data.tokenizer = "huggingface"  # data.tokenizer_path: the run's tokenizer.json
  c.data.seq_len = 8192

  c.train.global_batch = 64
  c.train.num_microbatches = 4
  c.train.num_steps = 100_000
  c.train.checkpoint_every = 1000
  c.train.log_every = 50

  c.optim.name = "adamw"
  c.optim.lr = 2e-4
  c.optim.warmup_steps = 1000
  c.optim.weight_decay = 0.1

  # The cluster, for the dry run: one TPU v4 slice of 16 chips (v4-32).
  c.parallel.fsdp = 16
  c.hardware = ml_collections.ConfigDict({"name": "tpu_v4", "topology": "v4:2x2x4"})

  c.lock()
  return c
