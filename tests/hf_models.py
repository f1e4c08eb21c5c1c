"""Tiny Hugging Face models built by transformers (CPU torch) with random weights, and a tokenizer
trained here, saved to directories (`make_hf`), and the pwtrain runs imported from them
(`make_imported`): what the conversion tests import. Nothing is downloaded.

Every weight is drawn (norms included, so Gemma's 1 + w is tested). The tokenizer is a
byte-level BPE whose post-processor adds a BOS, wrapped as transformers' fast tokenizer; the
models' vocabularies are its size.
"""

import pathlib
from typing import NamedTuple

import torch
import transformers

from pwtrain.convert import importer

COMMON = dict(
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  bos_token_id=1,
  eos_token_id=2,
  pad_token_id=0,
  max_position_embeddings=256,
)
# architecture -> (its config's own keys, the seed of its random weights).
MODELS = {
  "llama": (
    "LlamaConfig",
    dict(
      rope_theta=500000.0,
      rms_norm_eps=1e-5,
      rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
      },
    ),
  ),
  "mistral": ("MistralConfig", dict(sliding_window=8)),
  "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
  "qwen3": ("Qwen3Config", {}),
  "gemma": ("GemmaConfig", dict(num_key_value_heads=1)),
  "gemma2": (
    "Gemma2Config",
    dict(query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=50.0),
  ),
}
SEEDS = {"gemma": 3}  # weights whose greedy continuation runs 32 tokens without an EOS


def _tokenizer():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<pad>", "<bos>", "<eos>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  text = ["def main(): return 1", "hello world, the quick brown fox", "import os\nprint(os)"]
  tok.train_from_iterator(text * 4, trainer)
  tok.post_processor = processors.TemplateProcessing(
    single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
  )
  return transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
  )


def make_hf(name, directory, *, dtype=None, **more):
  """A tiny random `name` model and the tokenizer, saved to `directory`; the model."""
  tok = _tokenizer()
  config_class, keys = MODELS[name]
  config = getattr(transformers, config_class)(**{**COMMON, "vocab_size": len(tok), **keys, **more})
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  generator = torch.Generator().manual_seed(SEEDS.get(name, 1))
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
  if dtype is not None:
    model = model.to(dtype)
  model.save_pretrained(directory)
  tok.save_pretrained(directory)
  return model.eval()


class Imported(NamedTuple):
  """A tiny HF checkpoint and the pwtrain run imported from it."""

  hf: pathlib.Path  # the checkpoint's directory (make_hf's)
  model: transformers.PreTrainedModel  # the model saved there, in eval mode
  run: pathlib.Path  # the workdir `importer.from_hf` wrote from it


def make_imported(name, root, **more) -> Imported:
  """`make_hf(name, root / "hf", **more)`, then `importer.from_hf` of it into `root / "run"`."""
  root = pathlib.Path(root)
  model = make_hf(name, root / "hf", **more)
  importer.from_hf(str(root / "hf"), str(root / "run"))
  return Imported(root / "hf", model, root / "run")
