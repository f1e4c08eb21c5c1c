"""Which operation first tells GRPO's programs apart in float32 (docs/rl.md, docs/benchmarks.md).

  python experiments/rl_ops.py --checkpoint=/tmp/bench_rl/seed0/checkpoints/100
  python experiments/rl_ops.py --checkpoint=... --ynn_reduce  # XLA:CPU's default reductions

From a checkpoint of grpo_toy, on one batch of the task's rows (prompts of the shift task, each
completed by its answer), each layer's intermediates of three programs side by side:
  forward    the model's forward pass, jitted alone ([batch, seq_len])
  gradient   GRPO's loss and gradients (step.loss_and_grads), jitted: the training step's
  decode     the engine's programs emulated (rl_mismatch.py): a prefill of [1, seq_len + 1] into
             each row's cache slot, then decodes of [batch, 1] over seq_len + 1 positions; its
             intermediates are those of the decode of position --position
Each intermediate (the embedding; per layer the LayerNorm, q/k/v, the attention core, its
output projection, the MLP and the block's output; the final norm, the logits) is read out of
the program running by jax.debug.callback; the logits are checked equal to the same program's
without callbacks, so that reading them changed nothing. Printed per intermediate: the largest
|value| and the largest |difference| of gradient and decode against forward, and the share of
entries that differ. pwtrain's commands run XLA:CPU with platforms.CPU_NUMERICS_FLAG;
--ynn_reduce names the flag with XLA's default instead (reductions and the elementwise
operations fused with them to YNNPACK).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--ynn_reduce" in sys.argv:  # named, so platforms.with_cpu_numerics leaves it
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type=+reduce"
  )
import common  # noqa: E402

common.force_host_devices(8)

TAPPED = {  # (module, class, method): the name of its output
  ("palm", "PaLM", "embed"): "embed",
  ("layers", "LayerNorm", "__call__"): "norm",
  ("layers", "Attention", "project"): "q",  # and "k", "v"
  ("layers", "Attention", "output"): "attn_out",
  ("layers", "GatedMLP", "__call__"): "mlp",
  ("blocks", "ParallelBlock", "with_stats"): "block",
  ("palm", "PaLM", "head"): "logits",
}


class Taps:
  """The tapped intermediates of the program running now (`into`), by name and occurrence:
  "norm#0" is the first LayerNorm's output."""

  def __init__(self):
    self.runs, self.into, self.on = {}, None, False

  def __call__(self, name, x):
    if not self.on:
      return x
    import jax
    import numpy as np

    def keep(value):
      if self.into is None:
        return
      seen = self.runs.setdefault(self.into, {})
      i = sum(key.startswith(f"{name}#") for key in seen)
      seen[f"{name}#{i}"] = np.asarray(value)

    jax.debug.callback(keep, x)
    return x

  def install(self):
    from pwtrain.models import blocks, layers, palm

    modules = {"palm": palm, "layers": layers, "blocks": blocks}
    for (module, cls, method), name in TAPPED.items():
      owner = getattr(modules[module], cls)
      setattr(owner, method, self._wrapped(getattr(owner, method), name, method == "project"))
    attend = layers.attend
    layers.attend = lambda *a, **k: self("attend", attend(*a, **k))

  def _wrapped(self, fn, name, project):
    def wrapped(module, *args, **kwargs):
      out = fn(module, *args, **kwargs)
      self(name, out[0] if isinstance(out, tuple) else out)
      if project:
        self("k", out[1])
        self("v", out[2])
      return out

    return wrapped


def task_batch(config, rows: int):
  """`rows` prompts of the shift task completed by their answers and EOS: inputs [rows,
  seq_len], targets (the completion's tokens; -1 elsewhere), the prompt's length."""
  import numpy as np

  from pwtrain.rl import tasks

  tokenizer = tasks.tokenizer(config.rl.task)
  length = config.data.seq_len
  inputs = np.zeros((rows, length), np.int32)
  targets = np.full((rows, length), -1, np.int32)
  prompt_len = 0
  task = tasks.ShiftPrompts(config.seed)
  for b in range(rows):
    row = task.row(b)
    prompt = list(tokenizer.prompt(row["prompt"]))
    answer = [*tokenizer.encode(row["answer"]).tolist(), tokenizer.eos_id]
    sequence = (prompt + answer)[: length + 1]
    inputs[b, : len(sequence) - 1] = sequence[:-1]
    targets[b, len(prompt) - 1 : len(sequence) - 1] = sequence[len(prompt) :]
    prompt_len = len(prompt)
  return inputs, targets, prompt_len


def rsqrt_alike(x) -> dict:
  """A LayerNorm's rsqrt, rsqrt(mean(x^2)) over the last dim of `x` (the embeddings), in one
  program (the reduction's fusion computes it) against rsqrt of the same means in a program of
  its own (XLA's elementwise emitter): the share of entries that differ, and how many of each
  are not the correctly rounded float32."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
  means = np.asarray(jax.jit(lambda x: jnp.mean(jnp.square(x), -1))(x))
  fused = np.asarray(jax.jit(lambda x: jax.lax.rsqrt(jnp.mean(jnp.square(x), -1)))(x))
  alone = np.asarray(jax.jit(jax.lax.rsqrt)(means))
  exact = (1 / np.sqrt(means.astype(np.float64))).astype(np.float32)
  return {
    "share_differing": float(np.mean(fused != alone)),
    "fused_not_correctly_rounded": float(np.mean(fused != exact)),
    "alone_not_correctly_rounded": float(np.mean(alone != exact)),
  }


def restore_params(config, checkpoint: str) -> dict:
  """The params of `checkpoint` (a run's checkpoints/<step>), on the host."""
  import tempfile

  import jax

  from pwtrain import restore

  with tempfile.TemporaryDirectory() as alone:  # restore.latest of that checkpoint alone
    os.makedirs(os.path.join(alone, "checkpoints"))
    name = os.path.basename(checkpoint.rstrip("/"))
    os.symlink(os.path.abspath(checkpoint), os.path.join(alone, "checkpoints", name))
    _, state = restore.latest(config, alone, restore.reading_mesh(config))
  return jax.device_get(state["params"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="a grpo_toy run's checkpoints/<step>")
  parser.add_argument("--rows", type=int, default=256, help="the batch (the run's: 256)")
  parser.add_argument("--position", type=int, default=12, help="the decode compared")
  parser.add_argument("--ynn_reduce", action="store_true", help="XLA:CPU's default reductions")
  parser.add_argument("--out", default="", help="write the results as JSON here")
  common.add_config_args(parser, default="grpo_toy")
  args = parser.parse_args()
  config = common.load_config(args.config, common.parse_sets(args.set))

  import jax
  import jax.numpy as jnp
  import numpy as np

  from pwtrain import objectives
  from pwtrain import step as step_lib
  from pwtrain.models import decode
  from pwtrain.rl import tasks

  taps = Taps()
  taps.install()
  params = restore_params(config, args.checkpoint)
  fns = step_lib.model_fns(config.model, config.moe)
  inputs, targets, prompt = task_batch(config, args.rows)
  rows, length = inputs.shape
  max_len = length + 1
  objective = objectives.make(config, tasks.tokenizer(config.rl.task).vocab_size)
  batch = {"inputs": inputs, "targets": targets,
           "advantages": np.ones((rows, length), np.float32),
           "behavior_logprobs": np.zeros((rows, length), np.float32)}  # fmt: skip
  batch = {k: batch[k] for k in objective.columns}

  def forward(params, inputs):  # traced afresh each call: taps on or off
    return jax.jit(lambda p, x: fns.module(p)(x))(params, inputs)

  loss_and_grads = step_lib.loss_and_grads(fns, objective=objective)
  seen = {}
  loss = objectives.GRPO.loss

  def gradient_logits(params, batch):
    def kept(self, logits, labels, reference_logits=None):
      jax.debug.callback(lambda z: seen.update(z=np.asarray(z)), logits)
      return loss(self, logits, labels, reference_logits)

    objectives.GRPO.loss = kept
    try:
      jax.block_until_ready(jax.jit(lambda p, b: loss_and_grads(p, b))(params, batch))
    finally:
      objectives.GRPO.loss = loss
    return seen.pop("z")

  def prefill(params, cache, tokens, slot):
    positions = jnp.minimum(jnp.arange(max_len), max_len - 1)[None]
    at = jnp.asarray([prompt - 1])
    return decode.forward(fns.module(params), cache, tokens, positions, rows=slot, logits_at=at)

  def step_once(params, cache, tokens, position):
    positions = jnp.full((rows, 1), position, jnp.int32)
    at = jnp.zeros((rows,), jnp.int32)
    return decode.forward(fns.module(params), cache, tokens[:, None], positions, logits_at=at)

  def decoded():
    """The emulated engine's logits of every decoded position [rows, positions, vocab], the
    intermediates of --position's decode kept when taps are on."""
    prefilled = jax.jit(lambda *a: prefill(*a))  # traced afresh: taps on or off
    stepped = jax.jit(lambda *a: step_once(*a))
    cache = decode.init_cache(fns.module(params), rows, max_len)
    for slot in range(rows):
      tokens = np.zeros((1, max_len), np.int32)
      tokens[0, :prompt] = inputs[slot, :prompt]
      _, cache = prefilled(params, cache, tokens, np.asarray([slot], np.int32))
    logits = {}
    for position in range(prompt, length):
      taps.into = "decode" if position == args.position else None
      logits[position], cache = stepped(params, cache, jnp.asarray(inputs[:, position]), position)
      logits[position] = np.asarray(logits[position])
      jax.effects_barrier()
    taps.into = None
    return logits

  plain = {
    "forward": np.asarray(forward(params, inputs)),
    "gradient": gradient_logits(params, batch),
  }
  plain["decode"] = decoded()
  taps.on = True
  taps.into = "forward"
  tapped = {"forward": np.asarray(forward(params, inputs))}
  jax.effects_barrier()
  taps.into = "gradient"
  tapped["gradient"] = gradient_logits(params, batch)
  jax.effects_barrier()
  tapped["decode"] = decoded()
  same = {
    "forward": np.array_equal(plain["forward"], tapped["forward"]),
    "gradient": np.array_equal(plain["gradient"], tapped["gradient"]),
    "decode": all(np.array_equal(plain["decode"][p], tapped["decode"][p]) for p in plain["decode"]),
  }
  base = taps.runs["forward"]
  rows_out = []
  for name, value in base.items():
    row = {"name": name, "max_abs": float(np.abs(value).max())}
    for other in ("gradient", "decode"):
      theirs = taps.runs[other][name]
      mine = value[:, args.position : args.position + 1] if other == "decode" else value
      d = np.abs(mine.astype(np.float64) - theirs)
      row[other] = {"max_abs_diff": float(d.max()), "share_differing": float(np.mean(d > 0))}
    rows_out.append(row)
  whole = {
    "gradient_vs_forward_logits": float(np.abs(plain["gradient"] - plain["forward"]).max()),
    "decode_vs_forward_logits": max(
      float(np.abs(plain["decode"][p] - plain["forward"][:, p]).max()) for p in plain["decode"]
    ),
  }
  rsqrt = rsqrt_alike(taps.runs["forward"]["block#0"])  # the second LayerNorm's input
  results = {"rsqrt": rsqrt, "machine": common.machine(), "xla_flags": os.environ["XLA_FLAGS"],
             "checkpoint": args.checkpoint, "position": args.position,
             "taps_changed_nothing": same, "logits": whole, "intermediates": rows_out}  # fmt: skip
  print(f"XLA_FLAGS={results['xla_flags']}\ntaps changed nothing: {same}\n{whole}")
  print(f"rsqrt: {results['rsqrt']}")
  print(f"{'':12s} {'max|x|':>8s}  gradient-forward (share)  decode-forward (share)")
  for r in rows_out:
    g, d = r["gradient"], r["decode"]
    gradient = f"{g['max_abs_diff']:9.2g} ({g['share_differing']:.2f})"
    decoded_ = f"{d['max_abs_diff']:9.2g} ({d['share_differing']:.2f})"
    print(f"{r['name']:12s} {r['max_abs']:8.3g}  {gradient}          {decoded_}")
  if args.out:
    common.write_json(args.out, results)


if __name__ == "__main__":
  main()
