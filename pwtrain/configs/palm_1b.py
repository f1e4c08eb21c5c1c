"""A ~1B-parameter PaLM-style model for one accelerator (949M parameters): what MFU is measured on.

Run (one NVIDIA GPU; on a CPU this config is far too slow to train):
  python -m pwtrain.main --config=palm_1b --workdir=/tmp/palm_1b
Every log line then gives tokens/s, model TFLOP/s and MFU (model FLOPs 6N + 12LHKT per token
over the device's peak: 989 TFLOP/s dense bf16 for an H100). Its memory plan:
  python -m pwtrain.main --config=palm_1b --dry_run

16 layers, d_model 2048, 16 heads of 128 with one shared key/value head (multi-query), SwiGLU
d_ff 8192 (4 d_model), sequence length 2048, global batch 16 sequences (32k tokens per step).
Compute in bf16 with float32 parameters, optimizer state and loss reductions; attention by
cuDNN's fused kernel (model.attention="cudnn"; "xla" elsewhere); scanned layers with remat
"dots" (matmul outputs kept, the rest recomputed). Byte tokens of the built-in corpus (every
file of the Python standard library), as palm_tiny reads them; the data does not change the
arithmetic, so any prepared TFDS text dataset will do (data.dataset, data.tokenizer).

Memory by the dry run's arithmetic (80 GB H100): parameters 3.8 GB, Adafactor state 7.6 GB,
gradients 3.8 GB, activations at "dots" 41.5 kB per token and layer, 30.6 GB for the whole
batch in one pass: ~46 GB. Without remat (111 kB per token and layer) it would need ~82 GB,
or train.num_microbatches=2.
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.model.num_layers = 16
  c.model.d_model = 2048
  c.model.num_heads = 16
  c.model.num_kv_heads = 1
  c.model.head_dim = 128
  c.model.d_ff = 4 * 2048
  c.model.vocab_size = 512  # bytes, padded (palm_tiny's tokenizer)
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.attention = "cudnn"
  c.model.scan_layers = True
  c.model.remat = "dots"

  c.data.max_files = 0  # every file of the built-in corpus
  c.data.seq_len = 2048

  c.train.global_batch = 16
  c.train.num_steps = 2000
  c.train.checkpoint_every = 500
  c.train.log_every = 20
  c.train.eval_every = 500

  c.optim.warmup_steps = 200

  c.parallel.devices_per_island = 1  # one accelerator, however many the host has
  c.hardware = "h100"  # for the dry run (`--dry_run`): one H100's memory and peak

  c.lock()
  return c
