"""PaLM 8b (Chowdhery et al., 2022, Table 1): 32 layers, 16 heads, d_model 4096, 8.63B parameters.

Run (needs an accelerator cluster; here it only loads, validates and plans):
  python -m pwtrain.main --config=palm_8b --workdir=/tmp/palm_8b
Plan it, and compile its real step for the TPU topology on this host (the [tpu] extra):
  python -m pwtrain.main --config=palm_8b --dry_run --compile

Shapes from the paper: d_ff = 4 d_model, head_dim 256, multi-query attention, 256k SentencePiece
vocabulary, sequence length 2048, global batch 512 sequences (the end of PaLM 8B's 256 -> 512
ramp). It starts from palm_tiny and keeps its optimizer (Adafactor, PaLM schedule with 10k
constant steps), with bf16 compute; palm_62b and palm_540b start from it.
"""

import ml_collections

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.model.num_layers = 32
  c.model.num_heads = 16
  c.model.num_kv_heads = 1
  c.model.d_model = 4096
  c.model.head_dim = 256
  c.model.d_ff = 4 * 4096
  c.model.vocab_size = 256_000
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True  # one scanned block to compile, not 32 (palm_62b, palm_540b too)

  c.data.dataset = "c4"  # any prepared TFDS text dataset (PaLM used its own mixture)
  c.data.tokenizer = "sentencepiece"
  c.data.sp_vocab_size = 256_000
  c.data.seq_len = 2048

  c.train.global_batch = 512
  c.train.num_steps = 255_000
  c.train.checkpoint_every = 1000
  c.train.log_every = 50

  c.optim.warmup_steps = 0
  c.optim.constant_steps = 10_000

  # The cluster, for the dry run: one TPU v4 slice of 64 chips (v4-128), every weight sharded
  # over all of them. Remat "dots" and 8 microbatches of one sequence per chip fit 32 GiB per
  # chip by the compiled step (--dry_run --compile: ~21 GB); without remat XLA needs 36 GB.
  c.parallel.fsdp = 64
  c.model.remat = "dots"
  c.train.num_microbatches = 8
  c.hardware = ml_collections.ConfigDict({"name": "tpu_v4", "topology": "v4:4x4x4"})

  c.lock()
  return c
