"""What model.attention="invariant" costs against "einsum" (docs/models.md, docs/benchmarks.md).

  python experiments/attention_invariant.py [--repeats=30]

time    grpo_toy's serving programs at an RL run's shapes (rl/rollouts.py): a prefill of
        [256, max_len=17] into the cache's rows and a decode step of 256 rows over 17 keys, each
        jitted with the cache donated (as the engine runs them); the two settings' calls
        alternated, medians of --repeats calls.
memory  XLA:CPU's temporary bytes (compiled memory_analysis) of grpo_toy's forward pass and of
        the gradient of a loss of its logits, at [256, 16], [16, 256] and [4, 1024] tokens.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.force_host_devices(1)

SETTINGS = ("einsum", "invariant")
ROWS, SEQ_LEN = 256, 16


def _programs(attention: str) -> dict:
  import jax
  import jax.numpy as jnp

  from pwtrain import step as step_lib
  from pwtrain.models import decode

  config = common.load_config("grpo_toy", {"model.attention": attention})
  fns = step_lib.model_fns(config.model, config.moe)
  params = fns.init(jax.random.key(0))
  max_len = SEQ_LEN + 1

  def run(p, c, tokens, positions, at, rows=None):
    return decode.forward(fns.module(p), c, tokens, positions, rows=rows, logits_at=at)

  step = jax.jit(run, donate_argnums=1)
  fresh = decode.init_cache(fns.module(params), ROWS, max_len)
  state = {"cache": jax.tree.map(lambda x: x.copy(), fresh)}  # k and v: distinct buffers
  chunk = jnp.zeros((ROWS, max_len), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), chunk.shape)
  at, rows = jnp.full((ROWS,), 7, jnp.int32), jnp.arange(ROWS, dtype=jnp.int32)
  one, ten = jnp.zeros((ROWS, 1), jnp.int32), jnp.full((ROWS, 1), 10, jnp.int32)

  def prefill():
    out, state["cache"] = step(params, state["cache"], chunk, positions, at, rows)
    return out

  def decode_step():
    out, state["cache"] = step(params, state["cache"], one, ten, at * 0)
    return out

  return {"prefill": prefill, "decode": decode_step}


def timing(repeats: int) -> dict:
  import jax

  programs = {a: _programs(a) for a in SETTINGS}
  for kinds in programs.values():
    for fn in kinds.values():
      jax.block_until_ready(fn())  # compiled
  seconds = {(a, k): [] for a in SETTINGS for k in ("prefill", "decode")}
  for _ in range(repeats):
    for a, k in seconds:
      start = time.perf_counter()
      jax.block_until_ready(programs[a][k]())
      seconds[(a, k)].append(time.perf_counter() - start)
  return {f"{k}_{a}_ms": round(statistics.median(s) * 1e3, 2) for (a, k), s in seconds.items()}


def memory() -> dict:
  import jax
  import jax.numpy as jnp

  from pwtrain import step as step_lib

  out = {}
  for attention in SETTINGS:
    for batch, seq_len in ((256, 16), (16, 256), (4, 1024)):
      config = common.load_config(
        "grpo_toy", {"model.attention": attention, "data.seq_len": seq_len}
      )
      fns = step_lib.model_fns(config.model, config.moe)
      params = jax.eval_shape(fns.init, jax.random.key(0))
      tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
      forward = jax.jit(lambda p, x, fns=fns: fns.module(p)(x))
      grad = jax.jit(jax.grad(lambda p, x, fns=fns: jnp.mean(fns.module(p)(x) ** 2)))
      for name, fn in (("forward", forward), ("gradient", grad)):
        compiled = fn.lower(params, tokens).compile()
        key = f"{name}_{attention}_{batch}x{seq_len}_temp_bytes"
        out[key] = compiled.memory_analysis().temp_size_in_bytes
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--out", default="", help="write the results as JSON here")
  args = parser.parse_args()
  results = {"machine": common.machine(), **timing(args.repeats), **memory()}
  for key, value in results.items():
    print(key, value, flush=True)
  if args.out:
    common.write_json(args.out, results)


if __name__ == "__main__":
  main()
