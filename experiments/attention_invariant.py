"""What model.attention="invariant" costs against "einsum" (docs/models.md, docs/benchmarks.md).

  python experiments/attention_invariant.py [--repeats=30]

time    grpo_toy's serving programs at an RL run's shapes (rl/rollouts.py): a prefill of
        [256, max_len=17] into the cache's rows and a decode step of 256 rows over 17 keys, each
        jitted with the cache donated (as the engine runs them); the two settings' calls
        alternated, medians of --repeats calls.
scores  where the time goes: one layer's attention scores at the prefill's shapes (q [256, 17, 4,
        16] projected from activations, with and without RoPE applied to it; k [256, 17, 4,
        16]), jitted alone, medians of --repeats: the einsum, the product and sum alone, and
        the product and sum after q's exact product with the identity (layers.attend's).
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


def scores(repeats: int) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pwtrain.models import layers

  rng = np.random.default_rng(0)
  b, length, h, d = ROWS, SEQ_LEN + 1, 4, 16
  x = jnp.asarray(rng.normal(size=(b, length, 64)), jnp.float32)
  wq = jnp.asarray(rng.normal(size=(64, h, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, length, h, d)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))

  def make(kind: str, rope: bool):
    def fn(x, wq, k):
      q = jnp.einsum("bld,dhk->blhk", x, wq)
      if rope:
        q = layers.rope(q, positions, 10000.0)
      q = q.reshape(b, length, h, 1, d)
      if kind == "einsum":
        return jnp.einsum("blgrk,bmgk->bgrlm", q, k)
      if kind == "invariant_identity":  # layers.attend's: q kept by an exact identity product
        q = jnp.einsum("blgrk,kj->blgrj", q, jnp.eye(d, dtype=q.dtype))
      keys = k.transpose(0, 2, 1, 3)[:, :, None, None]
      return jnp.sum(q.transpose(0, 2, 3, 1, 4)[:, :, :, :, None] * keys, axis=-1)

    return jax.jit(fn)

  fns = {
    f"scores_{kind}_{'rope' if rope else 'no_rope'}_ms": make(kind, rope)
    for kind in ("einsum", "invariant", "invariant_identity")
    for rope in (False, True)
  }
  for fn in fns.values():
    jax.block_until_ready(fn(x, wq, k))
  seconds = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(x, wq, k))
      seconds[name].append(time.perf_counter() - start)
  return {name: round(statistics.median(s) * 1e3, 2) for name, s in seconds.items()}


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
  results = {
    "machine": common.machine(),
    **timing(args.repeats),
    **scores(args.repeats),
    **memory(),
  }
  for key, value in results.items():
    print(key, value, flush=True)
  if args.out:
    common.write_json(args.out, results)


if __name__ == "__main__":
  main()
