"""What platforms.CPU_NUMERICS_FLAG costs in time on XLA:CPU (docs/benchmarks.md, GRPO section).

  python experiments/cpu_numerics_time.py                 # with the flag, as pwtrain runs
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=+reduce python experiments/cpu_numerics_time.py

One setting per process (XLA reads its flags once); alternate the two commands and compare
medians taken under the same load. Timed: GRPO's gradient program (step.loss_and_grads, jitted)
and the forward pass (jitted), for grpo_toy ([256, 16]) and for a 4-layer d_model 256 model
([16, 256]) from random initialisation; the median of --repeats calls after one warm call.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.force_host_devices(8)

MODELS = {  # name: (overrides of grpo_toy, batch rows, sequence length)
  "grpo_toy": ({}, 256, 16),
  "d256": (
    {"model.d_model": 256, "model.num_layers": 4, "model.num_heads": 8, "model.head_dim": 32,
     "model.num_kv_heads": 1, "model.d_ff": 1024, "model.vocab_size": 256},
    16,
    256,
  ),
}  # fmt: skip


def timed(fn, args, repeats: int) -> float:
  import jax

  jax.block_until_ready(fn(*args))
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  import jax
  import numpy as np

  from pwtrain import objectives
  from pwtrain import step as step_lib

  results = {"xla_flags": os.environ["XLA_FLAGS"], "machine": common.machine()}
  for name, (overrides, rows, length) in MODELS.items():
    config = common.load_config("grpo_toy", overrides)
    fns = step_lib.model_fns(config.model, config.moe)
    params = fns.init(jax.random.key(0))
    inputs = np.random.default_rng(0).integers(0, config.model.vocab_size, (rows, length))
    inputs = inputs.astype(np.int32)
    batch = {"inputs": inputs, "targets": inputs,
             "advantages": np.ones((rows, length), np.float32),
             "behavior_logprobs": np.zeros((rows, length), np.float32)}  # fmt: skip
    grads = jax.jit(step_lib.loss_and_grads(fns, objective=objectives.make(config)))
    forward = jax.jit(lambda p, x: fns.module(p)(x))  # noqa: B023
    results[name] = {
      "gradient_s": timed(grads, (params, batch), args.repeats),
      "forward_s": timed(forward, (params, inputs), args.repeats),
    }
    print(name, results[name], flush=True)
  print(results["xla_flags"])


if __name__ == "__main__":
  main()
