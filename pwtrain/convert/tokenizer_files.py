"""The tokenizer's files of a Hugging Face checkpoint, checked against the model, copied into a
run (`<workdir>/tokenizer/`) and back out with an export.

A checkpoint's `tokenizer.json` (the `tokenizers` library's file, which pwtrain's
data.tokenizer="huggingface" reads) is required; `tokenizer_config.json`,
`special_tokens_map.json`, `generation_config.json` and `chat_template.jinja` (the chat template,
where transformers 5 writes it) travel with it where they exist. The
tokenizer must fit the model: no more ids than model.vocab_size, and the end-of-sequence token
(tokenizer_config.json's `eos_token`, else config.json's first `eos_token_id`) must be one of its
ids. Generation stops where transformers' `generate` stops: at every id of `eos_token_id` (an id
or a list: Llama 3's) in generation_config.json, else in config.json; those besides the EOS token
become data.stop_tokens, by their text.
"""

import os
import shutil

from pwtrain.convert.hf_config import read_json
from pwtrain.errors import DataError

TOKENIZER = "tokenizer.json"
COMPANIONS = (
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
  "chat_template.jinja",  # transformers 5 writes the chat template here
)
RUN_DIR = "tokenizer"  # under the workdir


def check(directory: str, hf_config: dict, vocab_size: int) -> dict:
  """The data.* keys of the checkpoint in `directory`'s tokenizer: {"data.tokenizer",
  "data.eos_token", "data.add_special_tokens", "data.stop_tokens"}; a DataError naming the file
  and key when it is missing or does not fit a model of `vocab_size` ids."""
  path = os.path.join(directory, TOKENIZER)
  if not os.path.isfile(path):
    raise DataError(
      f"{path} is missing: the checkpoint's tokenizer (the `tokenizers` library's JSON, which "
      "transformers saves with the model) is needed to encode its text"
    )
  import tokenizers

  try:
    tok = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # noqa: BLE001 - the library raises its own exception types
    raise DataError(f"{path} is not a tokenizers JSON file ({str(e)[:200]})") from None
  size = tok.get_vocab_size(with_added_tokens=True)
  if size > vocab_size:
    raise DataError(
      f"{path}: the tokenizer has {size} ids, the model's embedding {vocab_size} "
      f"(config.json vocab_size): the tokenizer does not belong to this model"
    )
  eos, source = _eos_token(directory, hf_config, tok)
  if eos is None or tok.token_to_id(eos) is None:
    raise DataError(
      f"{source}: the end-of-sequence token {eos!r} is not in {path}'s vocabulary: the "
      "tokenizer does not belong to this model"
    )
  return {
    "data.tokenizer": "huggingface",
    "data.eos_token": eos,
    "data.add_special_tokens": True,
    "data.stop_tokens": tuple(t for t in _stop_tokens(directory, hf_config, tok) if t != eos),
  }


def _stop_tokens(directory: str, hf_config: dict, tok) -> list[str]:
  """The texts of the ids generation stops at: generation_config.json's eos_token_id, else
  config.json's (an id, or a list of them). As transformers' generate, except where
  generation_config.json exists without the key: transformers then stops at no id, and this
  takes config.json's (a model that ends its text with EOS ends here too)."""
  path = os.path.join(directory, "generation_config.json")
  generation = read_json(path) if os.path.isfile(path) else {}
  if isinstance(generation, dict) and generation.get("eos_token_id") is not None:
    ids, where = generation["eos_token_id"], f"{path} eos_token_id"
  else:
    ids = hf_config.get("eos_token_id")
    where = f"{os.path.join(directory, 'config.json')} eos_token_id"
  ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
  tokens = []
  for i in ids:
    token = tok.id_to_token(i) if isinstance(i, int) and not isinstance(i, bool) else None
    if token is None:
      raise DataError(f"{where}={ids!r}: {i!r} is not an id of the tokenizer's vocabulary")
    tokens.append(token)
  return tokens


def _eos_token(directory: str, hf_config: dict, tok) -> tuple:
  """(the EOS token's text, the file that names it)."""
  config_path = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(config_path):
    eos = read_json(config_path).get("eos_token")
    if isinstance(eos, dict):
      eos = eos.get("content")
    if eos:
      return eos, f"{config_path} eos_token"
  ids = hf_config.get("eos_token_id")
  first = ids[0] if isinstance(ids, list) and ids else ids
  where = f"{os.path.join(directory, 'config.json')} eos_token_id={ids!r}"
  if not isinstance(first, int):
    return None, where
  return tok.id_to_token(first), where


def copy(source: str, target: str) -> list[str]:
  """Copies the tokenizer's files that exist from `source` to `target` (created); their names."""
  os.makedirs(target, exist_ok=True)
  names = [n for n in (TOKENIZER, *COMPANIONS) if os.path.isfile(os.path.join(source, n))]
  for name in names:
    shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
  return names


def generation_config(hf_config: dict) -> dict:
  """A generation_config.json for a checkpoint that came without one: its special token ids."""
  ids = ("bos_token_id", "eos_token_id", "pad_token_id")
  return {k: hf_config[k] for k in ids if k in hf_config}
