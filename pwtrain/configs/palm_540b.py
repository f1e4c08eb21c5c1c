"""PaLM 540b (Chowdhery et al., 2022, Table 1): 118 layers, 48 heads, d_model 18432, 540.35B params.

Run (needs an accelerator cluster; here it only loads, validates and plans):
  python -m pwtrain.main --config=palm_540b --workdir=/tmp/palm_540b
Plan it for its cluster without devices (memory per chip, bytes across pods, step time):
  python -m pwtrain.main --config=palm_540b --dry_run
Expected: 540.36B parameters on 2 pods x 3072 TPU v4 chips, mesh data=1 x fsdp=256 x tensor=12,
~0.73 GB of parameters per chip, ~1.4 GB of bf16 gradients per host pair per step across pods
(PaLM reports ~1.3 GB), ~23 GB per chip with the configured remat and microbatches (fits the
32 GiB), and a predicted ~16.5 s step at ~49% MFU. That prediction follows from the hardware
table's assumed efficiency (50% of peak on the executed FLOPs, pwtrain/dryrun/hardware.py), not
from PaLM's measurements; PaLM measured 46.2% MFU (57.8% hardware FLOPs utilisation).

Compile its real step for two v4:8x16x24 slices on this host ([tpu] extra; ~12 minutes here,
~3 of them compiling the step and the rest counting its FLOPs):
  python -m pwtrain.main --config=palm_540b --dry_run --compile
Compiled: at most 23.3 GB per chip (the FB piece's 19.6 GB of temporaries plus the train
state), so it fits by XLA's numbers too; FLOPs 1.02x the analytic count.

Memory plan (the dry run's figures per chip; 3.6 GB is the train state, 3.1 GB FSDP-gathered
weights and their unreduced gradients, the rest activations): a pod's 1024 sequences over
fsdp=256 are 4 sequences, 8192 tokens, per chip. Saving every activation (unrolled, remat
"none") takes ~161 GB; remat "dots" keeps per token and layer the block input and the q, k, v,
gate and up projections (64.5 kB instead of 164.9 kB) and recomputes only attention's scores and
weighted sum (+0.4% of the FLOPs), but at one microbatch that is still 65 GB and at two 33 GB:
four microbatches of one sequence per chip bring it to ~16 GB. "full" at two microbatches would
fit too (~23 GB), at +22% FLOPs (every projection but wo and w_down recomputed). Scanned at
"none", a block keeps every matmul output (82.9 kB: dots' and attention's scores and weighted
sum, models/remat.py), ~21 GB at four microbatches by the estimate; the compiled step has
checked "dots" only.

Shapes from the paper: d_ff = 4 d_model, head_dim 256, multi-query attention, 256k SentencePiece
vocabulary, sequence length 2048; the rest (optimizer, data, bf16 compute) as palm_62b/palm_8b.
The global batch is 2048 sequences, where PaLM's batch ramp (512 -> 1024 -> 2048 sequences)
ended and spent most of its steps.

The cluster is PaLM's (section 4): two TPU v4 pods of 3072 chips (768 hosts each), one island
per pod, joined by the data-center network; pods are data-parallel replicas that exchange
gradients every step (synchronously, in bf16). Inside a pod, PaLM used 12-way model parallelism
and 256-way fully sharded data parallelism: every weight is split over all 3072 chips. Here that
is fsdp=256 (batch and the "embed" dim of weights split over it) with data=1: data=256 would
replicate the weights over the batch axis and shard them only 12 ways (~180 GB per chip).
"""

import ml_collections

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_62b", arg)
  c.model.num_layers = 118
  c.model.num_heads = 48
  c.model.d_model = 18432
  c.model.d_ff = 4 * 18432
  # PaLM's 256k SentencePiece ids padded by 8 to a multiple of parallel.tensor=12 (a sharded
  # dimension must divide evenly): the tokenizer never produces ids 256000-256007, and training
  # pushes their logits down.
  c.model.vocab_size = 256_008
  c.train.global_batch = 2048
  # Fits 32 GiB per chip by the dry run's arithmetic (see the memory plan above).
  c.model.remat = "dots"
  c.train.num_microbatches = 4

  c.parallel.pods = 2  # two TPU v4 pods, data-parallel replicas of the whole model
  c.parallel.stages = 1  # no pipelining (PaLM avoided it)
  c.parallel.islands = 2  # one island per pod
  c.parallel.devices_per_island = 3072  # chips per pod
  c.parallel.data = 1
  c.parallel.fsdp = 256
  c.parallel.tensor = 12  # divides num_heads=48, d_ff and the padded vocab_size

  c.exchange.mode = "sync"
  c.exchange.compression = "bf16"  # gradients cross the DCN in bf16 (~1.3 GB per host pair)

  # The cluster's hardware, for the dry run's estimates: the tpu_v4 preset's numbers, each
  # sourced in pwtrain/dryrun/hardware.py; any can be overridden, e.g.
  # --config.hardware.dcn_bytes_per_s=12.5e9.
  c.hardware = ml_collections.ConfigDict(
    {
      "name": "tpu_v4",
      "peak_flops": 275e12,  # bf16 FLOP/s per chip
      "memory_bytes": 32.0 * 2**30,  # HBM per chip
      "devices_per_host": 4,
      "ici_bytes_per_s": 1.1e15 / 4096,  # per chip: v4 pod all-reduce bandwidth / 4096 chips
      "dcn_bytes_per_s": 81e12 / 8 / 1536,  # per host: PaLM's 81 Tb/s burst over 1536 hosts
      # ASSUMED fraction of peak on the executed FLOPs (hardware.py says what it rests on);
      # not PaLM's measured 57.8%, which the prediction is compared against.
      "efficiency": 0.5,
      # One pod's TPU topology (3072 chips); pods are slices (--dry_run --compile).
      "topology": "v4:8x16x24",
    }
  )

  c.lock()
  return c
