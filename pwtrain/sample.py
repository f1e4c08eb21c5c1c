"""Sampling from a trained run: `python -m pwtrain.sample --workdir=/tmp/run --prompt="def "`.

The run's config is `--config=<file>` (with `--config.<key>=<value>` overrides, as for
pwtrain.main) when given, else `<workdir>/config.json` (the resolved config a run saves); with
neither the command stops and says so. Its latest readable checkpoint
(`<workdir>/checkpoints`) is restored onto this machine whatever layout wrote it: checkpoints
hold the whole-model state, read here into a single-island mesh of parallel.fsdp *
parallel.expert * parallel.tensor local devices (parameters sharded by their logical axes, as
in training; parallel.data is 1, since a few prompts gain nothing from data parallelism). The
optimizer state and the exchange's state are restored with the parameters (the checkpoint holds
them; restore checks every array) and then dropped; runs whose pods differ (DiLoCo, error
feedback) sample from pod 0's parameters. The config's model.scan_layers picks the decoder's
layout (checkpoints hold layers unrolled; a scanned model stacks them and scans its decode),
whichever layout trained the run.

Prompts are `--prompt`, or `--prompt_file` (one prompt per line; blank lines skipped). Each is
fed as the start of a document, as in training's packed stream (after an EOS; with
data.add_special_tokens, an imported model's, as transformers encodes it: the tokenizer's BOS
where it adds one, no EOS in front) and continued
`--num_samples` times by up to `--max_new_tokens` tokens (models/sampling.py: `--temperature`
0 is greedy, `--top_k`, `--top_p`), stopping at EOS or any other of the tokenizer's stop ids
(data.stop_tokens: an imported model's eos_token_id list). All rows decode as one batch with a
KV cache (models/decode.py). Each sample is printed after a header line,
`--- prompt P, sample S: N new tokens[, stopped at EOS] (checkpoint step K) ---`, as the
prompt followed by its continuation (N does not count the EOS).
"""

import dataclasses
import os
import sys

from pwtrain import platforms

platforms.prepare()  # before JAX starts: whatever it can initialise (pwtrain/platforms.py)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pwtrain import config as config_lib  # noqa: E402
from pwtrain.errors import ConfigError  # noqa: E402
from pwtrain.inference import load_config, reading_mesh, restore_params, run_tokenizer  # noqa: E402
from pwtrain.models.sampling import Sampling, generate  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "The run's config: a shipped config's name or a file's path; default: <workdir>/config.json.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (checkpoints, tokenizer).")
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "A file of prompts, one per line.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "Tokens to add to each prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens; 0: all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling's probability mass; 1: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of the draws.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples per prompt.")


def read_prompts(prompt: str | None, prompt_file: str | None) -> list[str]:
  if (prompt is None) == (prompt_file is None):
    raise ConfigError("give exactly one of --prompt=<text> and --prompt_file=<file>")
  if prompt is not None:
    return [prompt]
  with open(prompt_file) as f:
    prompts = [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ConfigError(f"--prompt_file={prompt_file!r} has no non-blank line")
  return prompts


@dataclasses.dataclass(frozen=True)
class Sample:
  prompt: int  # index in the prompts
  sample: int  # 0..num_samples-1
  text: str  # the prompt followed by its continuation, decoded
  new_tokens: int  # tokens of the continuation, EOS not counted
  ids: tuple  # the continuation's token ids (its EOS included)
  stopped_at_eos: bool
  checkpoint_step: int


def sample(
  config,
  workdir: str,
  prompts: list[str],
  *,
  sampling: Sampling,
  max_new_tokens: int,
  num_samples: int,
  seed: int,
  devices=None,
) -> list[Sample]:
  """`num_samples` continuations of each prompt, prompt-major, from the run's latest checkpoint
  (see the module docstring), decoded in one batch on `devices` (default: the local ones)."""
  if max_new_tokens < 1 or num_samples < 1:
    raise ConfigError(
      f"--max_new_tokens={max_new_tokens} and --num_samples={num_samples} must be >= 1"
    )
  tokenizer = run_tokenizer(config, workdir)
  step, fns, params = restore_params(config, workdir, reading_mesh(config, devices))
  # A prompt starts a document, encoded as documents are in the packed training data: after an
  # EOS, or (data.add_special_tokens) with the tokenizer's own BOS (data/tokenizer.py).
  encoded = [tokenizer.prompt(p) for p in prompts]
  rows = [ids for ids in encoded for _ in range(num_samples)]
  lengths = np.asarray([len(ids) for ids in rows], np.int32)
  batch = np.full((len(rows), int(lengths.max())), tokenizer.pad_id, np.int32)
  for r, ids in enumerate(rows):
    batch[r, : len(ids)] = ids

  def run(params, prompts, lengths, key):
    return generate(
      fns.module(params),
      prompts,
      lengths,
      key,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      eos_id=tokenizer.stop_ids,
      pad_id=tokenizer.pad_id,
      num_tokens=tokenizer.vocab_size,
    )

  out = jax.device_get(jax.jit(run)(params, batch, lengths, jax.random.key(seed)))
  samples = []
  for r, ids in enumerate(rows):
    new = out.tokens[r, : int(out.lengths[r])]
    eos = bool(len(new) and new[-1] in tokenizer.stop_ids)
    samples.append(
      Sample(
        prompt=r // num_samples,
        sample=r % num_samples,
        text=tokenizer.decode(np.concatenate([ids, new])),  # special ids dropped
        new_tokens=len(new) - eos,
        ids=tuple(int(i) for i in new),
        stopped_at_eos=eos,
        checkpoint_step=step,
      )
    )
  return samples


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO.
  print(platforms.describe(), file=sys.stderr)
  try:
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    config = load_config(_CONFIG.value, workdir)
    prompts = read_prompts(_PROMPT.value, _PROMPT_FILE.value)
    sampling = Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
    samples = sample(
      config,
      workdir,
      prompts,
      sampling=sampling,
      max_new_tokens=_MAX_NEW_TOKENS.value,
      num_samples=_NUM_SAMPLES.value,
      seed=_SEED.value,
    )
  except (ValueError, OSError) as e:
    sys.exit(f"pwtrain.sample: {e}")
  for s in samples:
    stopped = ", stopped at EOS" if s.stopped_at_eos else ""
    print(
      f"--- prompt {s.prompt}, sample {s.sample}: {s.new_tokens} new tokens{stopped} "
      f"(checkpoint step {s.checkpoint_step}) ---"
    )
    print(s.text)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with `--config=<name>` naming a shipped config (config.resolve)."""
  try:
    return flags.FLAGS(config_lib.resolve_argv(argv))
  except ConfigError as e:
    raise SystemExit(f"pwtrain.sample: {e}") from None


if __name__ == "__main__":
  flags.mark_flags_as_required(["workdir"])
  app.run(main, flags_parser=parse_flags)
