"""GRPO on the toy "shift" task from random initialisation, on a CPU in minutes (docs/rl.md).

Run:
  python -m pwtrain.main --config=grpo_toy --workdir=/tmp/pwtrain_grpo

The prompt is 6 letters of "abcdefgh" and "=", the answer each letter shifted by one (cyclic),
the reward the fraction of positions right (chance: 1/8). A 2-layer rotary model with the task's
own 10-id vocabulary (EOS, 8 letters, "=") samples 8 completions of each of 32 prompts per step
from its live weights with the serving engine and trains on them with GRPO (train.objective).
Measured figures: docs/benchmarks.md.
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.model.vocab_size = 10  # the task's vocabulary exactly: the trainer's softmax is the sampler's
  c.model.num_layers = 2
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.head_dim = 16
  c.model.num_kv_heads = 4
  c.model.d_ff = 256
  c.model.z_loss = 0.0
  # The sampler's float32 log-probs equal the trainer's bitwise: the KV-cache decode's attention
  # rounds as the training forward's (layers.attend; docs/rl.md). A step takes about 1.25x as
  # long here, in its training (docs/benchmarks.md).
  c.model.attention = "invariant"
  # A model this small runs fastest on one device: on a CPU the simulated devices share its
  # cores, and splitting each step 8 ways makes it about 2.7x slower.
  c.parallel.devices_per_island = 1
  c.data.seq_len = 16  # EOS + 6 letters + "=" + up to 8 new tokens, less the last target
  c.train.objective = "grpo"
  c.train.global_batch = 256  # 32 prompts x rl.group_size 8
  c.train.num_steps = 150
  c.train.log_every = 10
  c.train.checkpoint_every = 50
  c.train.eval_every = 0
  c.optim.name = "adamw"
  c.optim.lr = 3e-3
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 5
  c.optim.weight_decay = 0.0
  c.rl.task = "shift"
  c.rl.group_size = 8
  c.rl.max_tokens = 8
  c.rl.temperature = 1.0
  c.lock()
  return c
