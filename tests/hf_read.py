"""What the installed transformers reads from a saved checkpoint: its logits for given tokens
and the dtype its config says. Imported by the export tests under transformers 5 (the venv's),
and run as a script by another interpreter with transformers 4.46 (test_convert_versions.py):

  python tests/hf_read.py TOKENS.npy CHECKPOINT_DIR OUT.npz [CHECKPOINT_DIR OUT.npz ...]

This file imports only numpy, torch and transformers (not pwtrain, not the tests' helpers), so
it runs alike under either version.
"""

import sys

import numpy as np
import torch
import transformers


def read(directory, tokens) -> dict:
  """{"version", "dtype" (the config's `torch_dtype` under 4.x, `dtype` under 5.x, as a name
  like "float32"; "None" when it read none), "logits" (float64, of the int tokens [batch, len],
  eager attention, no cache)}."""
  major = int(transformers.__version__.split(".")[0])
  config = transformers.AutoConfig.from_pretrained(directory)
  dtype = getattr(config, "torch_dtype" if major < 5 else "dtype", None)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    directory, attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    logits = model(torch.tensor(np.asarray(tokens), dtype=torch.long), use_cache=False).logits
  return {
    "version": transformers.__version__,
    "dtype": str(dtype).removeprefix("torch."),
    "logits": logits.double().numpy(),
  }


if __name__ == "__main__":
  tokens_file, *pairs = sys.argv[1:]
  for directory, out_file in zip(pairs[::2], pairs[1::2], strict=True):
    np.savez(out_file, **read(directory, np.load(tokens_file)))
