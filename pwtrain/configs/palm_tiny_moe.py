"""palm_tiny with sparse Mixture-of-Experts FFNs, one expert per device (expert parallelism).

Run:
  python -m pwtrain.main --config=palm_tiny_moe --workdir=/tmp/pwtrain_tiny_moe

Layers 1 and 3 (every second layer) replace the dense SwiGLU by 8 SwiGLU experts of hidden size
256 with top-2 (GShard) routing, so a token's active FFN parameters and FLOPs equal palm_tiny's
dense d_ff=512 (plus a 128 x 8 router): the two configs compare at equal compute per token. The
8 experts are split over parallel.expert=8 (tokens too: the batch of 16 is split 8 ways, and the
MoE layers exchange tokens all-to-all); capacity factor 1.25 in training. Metrics add
moe_aux_loss, moe_z_loss, moe_dropped_fraction and each expert's load (moe_load_e*). moe.d_ff=0
is model.d_ff // top_k, so --config.moe.top_k=1 gives 8 experts of 512 (still equal compute).
Expected: the ce_loss falls like palm_tiny's and after 300 steps ties it (2.385 vs 2.388, mean
of the last 20 steps), no lower. No MoE setting tried beats dense at equal active parameters
within 500 steps: e.g. 4 experts in every layer (--config.moe.num_experts=4 --config.moe.every=1
--config.moe.capacity_factor=2.0 --config.parallel.expert=4) end 0.04-0.05 below dense in 2 of 4
seeds and 0.02-0.07 above in the others (docs/benchmarks.md has the numbers).
Try also --config.moe.dropless=True or --config.parallel.expert=2
--config.parallel.data=4.
"""

from pwtrain.config import base_config


def get_config(arg=None):
  c = base_config(__file__, "palm_tiny", arg)
  c.moe.num_experts = 8
  c.moe.every = 2
  c.moe.top_k = 2
  c.moe.d_ff = 0  # model.d_ff // top_k: the same active FFN size as the dense model
  c.moe.capacity_factor = 1.25
  c.parallel.expert = 8
  c.parallel.data = -1
  c.lock()
  return c
