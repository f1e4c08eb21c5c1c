"""PaLM 540b (Chowdhery et al., 2022, Table 1): 118 layers, 48 heads, d_model 18432, 540.35B params.

Run (needs an accelerator cluster; here it only loads, validates and plans):
  python -m pwtrain.main --config=configs/palm_540b.py --workdir=/tmp/palm_540b

Shapes from the paper: d_ff = 4 d_model, head_dim 256, multi-query attention, 256k SentencePiece
vocabulary, sequence length 2048, global batch 6144 sequences. It starts from palm_tiny and keeps
its optimizer (Adafactor, PaLM schedule with 10k constant steps), with bf16 compute.
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.model.num_layers = 118
  c.model.num_heads = 48
  c.model.num_kv_heads = 1
  c.model.d_model = 18432
  c.model.head_dim = 256
  c.model.d_ff = 4 * 18432
  c.model.vocab_size = 256_000
  c.model.dtype = "bfloat16"

  c.data.dataset = "c4"  # any prepared TFDS text dataset (PaLM used its own mixture)
  c.data.tokenizer = "sentencepiece"
  c.data.sp_vocab_size = 256_000
  c.data.seq_len = 2048

  c.train.global_batch = 6144
  c.train.num_steps = 255_000
  c.train.checkpoint_every = 1000
  c.train.log_every = 50

  c.optim.warmup_steps = 0
  c.optim.constant_steps = 10_000

  c.lock()
  return c
