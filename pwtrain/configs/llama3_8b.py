"""Llama 3.1 8B (Grattafiori et al., 2024): 32 layers, d_model 4096, 32 query heads sharing 8
key/value heads, SwiGLU of 14336, 128,256-token vocabulary, an untied output layer: 8.03B
parameters.

Plan it for its cluster (here it only loads, validates and plans), and compile its real step for
the TPU topology on this host (the [tpu] extra):
  python -m pwtrain.main --config=llama3_8b --dry_run
  python -m pwtrain.main --config=llama3_8b --dry_run --compile

Its weights come from a Hugging Face directory (docs/models.md): `python -m pwtrain.convert
from_hf <dir> --workdir=<run>` writes that run's own config (these keys, read from the
directory's config.json) and a step-0 checkpoint, with the tokenizer. This file is the
architecture with Llama 3's training settings (AdamW, peak lr 3e-4, cosine decay, 8192-token
sequences) on a TPU v4 slice of 64 chips, every weight sharded over all of them (fsdp=64).
"""

import ml_collections

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.model.family = "llama"
  c.model.num_layers = 32
  c.model.d_model = 4096
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.d_ff = 14_336
  c.model.vocab_size = 128_256
  c.model.rope_base = 500_000.0
  c.model.rope_scaling = "llama3"  # Llama 3.1: factor 8, low/high 1 and 4, 8192 original
  c.model.norm_eps = 1e-5
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True
  c.model.remat = "full"

  c.data.dataset = "c4"  # any prepared TFDS text dataset
  c.data.tokenizer = "huggingface"  # data.tokenizer_path: the run's tokenizer.json
  c.data.seq_len = 8192

  c.train.global_batch = 256
  c.train.num_microbatches = 4
  c.train.num_steps = 100_000
  c.train.checkpoint_every = 1000
  c.train.log_every = 50

  c.optim.name = "adamw"
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 2000
  c.optim.weight_decay = 0.1

  # The cluster, for the dry run: one TPU v4 slice of 64 chips (v4-128).
  c.parallel.fsdp = 64
  c.hardware = ml_collections.ConfigDict({"name": "tpu_v4", "topology": "v4:4x4x4"})

  c.lock()
  return c
