"""Where GRPO's float32 generator/trainer log-prob mismatch peaks (docs/benchmarks.md, docs/rl.md).

  python experiments/bench_rl.py --sections=learning --seeds=0 --workdir=/tmp/bench_rl
  python experiments/rl_mismatch.py --workdir=/tmp/bench_rl/seed0 --seed=0  # [--reuse]

1. Replay: a copy of the learning run (grpo_toy, its --seed) resumes from its checkpoint of
   --from_step to its last step (a resume samples and trains what the run did, bitwise: the
   replayed steps' logprob_mismatch_max are checked equal to the run's), saving every step, with
   GRPO's loss wrapped to report each step's peak completion token: its row and position, the
   sampler's log-prob (behaviour), the training step's (logp) and the token's probability; the
   peaks and the steps' batches are kept in the copy (<workdir>_replay), which --reuse reads
   instead of replaying again.
2. At the largest peak, the log-probs of that token from the weights that sampled it (the
   checkpoint of the step before): the engine's (recorded), the engine's programs emulated with
   decode.forward at the engine's shapes (a prefill of [1, max_len] into the row's slot, then
   decodes of [global_batch, 1] over max_len positions; checked equal to the engine's), and a
   plain forward pass of the batch ([global_batch, seq_len], jitted alone), and the step's
   gradient program (step.loss_and_grads of the batch, jitted; checked equal to the step's).
   Their differences split the mismatch into the KV-cache decode's rounding and the gradient
   program's (its logits against the plain forward's); with the logits' differences dz between
   the decode and the plain forward it checks the first
   order |dlogp_t| = |sum_i p_i (dz_t - dz_i)| <= (1 - p_t) (max dz - min dz), and gives the
   decode-vs-forward mismatch over the whole batch.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.force_host_devices(8)


def _rows(workdir: str) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "logprob_mismatch_max" in r}


def replay(args, config, copy: str) -> tuple[list, list]:
  """Steps from_step+1 .. the run's last replayed in `copy`: (each step's peak, its batch), also
  written there (peaks.json, batches.npz)."""
  import jax
  import numpy as np

  from pwtrain import objectives, train
  from pwtrain.rl import rollouts

  shutil.rmtree(copy, ignore_errors=True)
  shutil.copytree(args.workdir, copy)
  for name in os.listdir(os.path.join(copy, "checkpoints")):
    if name.isdigit() and int(name) > args.from_step:
      shutil.rmtree(os.path.join(copy, "checkpoints", name))
  os.remove(os.path.join(copy, "metrics.jsonl"))
  peaks, batches = [], []

  def record(*arrays):
    targets, behavior, logp, logits = map(np.asarray, arrays)
    d = np.abs(behavior - logp) * (targets >= 0)
    b, t = np.unravel_index(np.argmax(d), d.shape)
    z = logits[b, t].astype(np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    peaks.append({"dlogp": float(d[b, t]), "row": int(b), "pos": int(t),
                  "token": int(targets[b, t]), "behavior": float(behavior[b, t]),
                  "logp": float(logp[b, t]), "p_token": float(p[targets[b, t]]),
                  "max_abs_logit": float(np.abs(z).max())})  # fmt: skip

  loss, make = objectives.GRPO.loss, rollouts.RolloutBatches.__next__

  def wrapped(self, logits, labels, reference_logits=None):
    logp = self.logprobs(logits, labels["targets"])
    jax.debug.callback(record, labels["targets"], labels["behavior_logprobs"], logp, logits)
    return loss(self, logits, labels, reference_logits)

  def batch(self):
    made = make(self)
    batches.append({k: np.asarray(v) for k, v in made.items()})
    return made

  objectives.GRPO.loss, rollouts.RolloutBatches.__next__ = wrapped, batch
  try:
    train.run(config, copy, show_progress=False)
  finally:
    objectives.GRPO.loss, rollouts.RolloutBatches.__next__ = loss, make
  common.write_json(os.path.join(copy, "peaks.json"), peaks)
  arrays = {f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()}
  np.savez(os.path.join(copy, "batches.npz"), **arrays)
  return peaks, batches


def reused(copy: str) -> tuple[list, list]:
  """What `replay` wrote in `copy`."""
  import numpy as np

  with open(os.path.join(copy, "peaks.json")) as f:
    peaks = json.load(f)
  arrays = np.load(os.path.join(copy, "batches.npz"))
  batches = [{} for _ in peaks]
  for name in arrays.files:
    i, k = name.split("/")
    batches[int(i)][k] = arrays[name]
  return peaks, batches


def paths(config, copy: str, step: int, peak: dict, batch: dict) -> dict:
  """The three log-probs of `peak`'s token (module doc 2) from the checkpoint of step - 1."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pwtrain import objectives, restore
  from pwtrain import step as step_lib
  from pwtrain.models import decode
  from pwtrain.models.sampling import sampled_logits
  from pwtrain.rl import tasks

  fns = step_lib.model_fns(config.model, config.moe)
  with tempfile.TemporaryDirectory() as alone:  # restore.latest of that checkpoint alone
    os.makedirs(os.path.join(alone, "checkpoints"))
    os.symlink(os.path.join(copy, "checkpoints", str(step - 1)),
               os.path.join(alone, "checkpoints", str(step - 1)))  # fmt: skip
    _, state = restore.latest(config, alone, restore.reading_mesh(config))
  params = jax.device_get(state["params"])
  inputs = batch["inputs"]
  rows, length = inputs.shape
  num_tokens = tasks.tokenizer(config.rl.task).vocab_size
  max_len, prompt = length + 1, length - config.rl.max_tokens  # the engine's; EOS + letters + "="

  @jax.jit
  def logprobs(logits, tokens):
    n = logits.shape[0]
    ones = jnp.ones((n,), jnp.float32)
    cut = sampled_logits(logits, ones, jnp.zeros((n,), jnp.int32), ones, num_tokens)
    return jnp.take_along_axis(jax.nn.log_softmax(cut, -1), tokens[:, None], -1)[:, 0]

  @jax.jit
  def prefill(params, cache, tokens, slot):
    positions = jnp.minimum(jnp.arange(max_len), max_len - 1)[None]
    at = jnp.asarray([prompt - 1])
    return decode.forward(fns.module(params), cache, tokens, positions, rows=slot, logits_at=at)

  @jax.jit
  def step_once(params, cache, tokens, position):
    positions = jnp.full((rows, 1), position, jnp.int32)
    at = jnp.zeros((rows,), jnp.int32)
    return decode.forward(fns.module(params), cache, tokens[:, None], positions, logits_at=at)

  cache = decode.init_cache(fns.module(params), rows, max_len)
  engine = {}
  first = []
  for slot in range(rows):
    tokens = np.zeros((1, max_len), np.int32)
    tokens[0, :prompt] = inputs[slot, :prompt]
    logits, cache = prefill(params, cache, tokens, np.asarray([slot], np.int32))
    first.append(np.asarray(logits)[0])
  engine[prompt - 1] = np.stack(first)
  for position in range(prompt, length):
    logits, cache = step_once(params, cache, jnp.asarray(inputs[:, position]), position)
    engine[position] = np.asarray(logits)
  forward = np.asarray(jax.jit(lambda p, x: fns.module(p)(x))(params, inputs))
  b, t, token = peak["row"], peak["pos"], peak["token"]
  seen = {}  # the gradient program's logp and logits at the peak
  objective, loss = objectives.make(config, num_tokens), objectives.GRPO.loss

  def wrapped(self, logits, labels, reference_logits=None):
    def keep(logp, z):
      seen.update(logp=float(np.asarray(logp)[b, t]), z=np.asarray(z)[b, t])

    jax.debug.callback(keep, self.logprobs(logits, labels["targets"]), logits)
    return loss(self, logits, labels, reference_logits)

  objectives.GRPO.loss = wrapped
  try:
    grads = jax.jit(step_lib.loss_and_grads(fns, objective=objective))
    jax.block_until_ready(grads(params, {k: batch[k] for k in objective.columns}))
  finally:
    objectives.GRPO.loss = loss
  at = lambda z: float(np.asarray(logprobs(jnp.asarray(z[None]), jnp.asarray([token])))[0])  # noqa: E731
  emulated, plain = at(engine[t][b]), at(forward[b, t])
  dz = (engine[t][b] - forward[b, t]).astype(np.float64)
  z = forward[b, t].astype(np.float64)
  p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  batch = []  # decode vs plain forward over every row's positions prompt-1 .. length-2
  for position in range(prompt - 1, length - 1):
    targets = jnp.asarray(inputs[:, position + 1])
    sampled = np.asarray(logprobs(jnp.asarray(engine[position]), targets))
    batch.append(np.abs(sampled - np.asarray(logprobs(jnp.asarray(forward[:, position]), targets))))
  batch = np.concatenate(batch)
  return {
    "emulated_engine_logp": emulated,
    "emulated_equals_engine": bool(np.float32(emulated) == np.float32(peak["behavior"])),
    "plain_forward_logp": plain,
    "engine_minus_plain": abs(peak["behavior"] - plain),
    "gradient_program_logp": seen["logp"],
    "gradient_program_equals_step": bool(np.float32(seen["logp"]) == np.float32(peak["logp"])),
    "step_minus_plain": abs(peak["logp"] - plain),
    "gradient_program_dz_max_abs": float(np.abs(seen["z"] - forward[b, t]).max()),
    "dz_max_abs": float(np.abs(dz).max()),
    "first_order_dlogp": abs(float(np.sum(p * (dz[token] - dz)))),
    "bound_1_minus_p_spread": float((1 - p[token]) * np.ptp(dz)),
    "batch_decode_vs_plain_max": float(batch.max()),
    "batch_decode_vs_plain_mean": float(batch.mean()),
    "batch_max_abs_logit": float(np.abs(forward).max()),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a finished learning run of grpo_toy")
  parser.add_argument("--seed", type=int, required=True, help="the run's seed")
  parser.add_argument("--from_step", type=int, default=100, help="a checkpoint of the run")
  parser.add_argument("--reuse", action="store_true", help="the replay already made, read")
  parser.add_argument("--out", default="", help="write the results as JSON here")
  common.add_config_args(parser, default="grpo_toy")
  args = parser.parse_args()
  original = _rows(args.workdir)
  last = max(original)
  overrides = {**common.parse_sets(args.set), "seed": args.seed, "train.num_steps": last,
               "train.checkpoint_every": 1, "train.keep_checkpoints": last}  # fmt: skip
  config = common.load_config(args.config, overrides)
  copy = args.workdir.rstrip("/") + "_replay"
  peaks, batches = reused(copy) if args.reuse else replay(args, config, copy)
  steps = list(range(args.from_step + 1, last + 1))
  replayed = _rows(copy)
  same = all(
    replayed[s]["logprob_mismatch_max"] == original[s]["logprob_mismatch_max"] for s in steps
  )
  top = max(range(len(peaks)), key=lambda i: peaks[i]["dlogp"])
  results = {
    "machine": common.machine(),
    "replayed_steps": f"{steps[0]}-{steps[-1]}",
    "replay_equals_run": same,
    "peak_step": steps[top],
    "peak": peaks[top],
    "paths": paths(config, copy, steps[top], peaks[top], batches[top]),
  }
  print(json.dumps(results, indent=1), flush=True)
  if args.out:
    common.write_json(args.out, results)


if __name__ == "__main__":
  main()
