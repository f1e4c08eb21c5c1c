"""The TFDS builders of the local corpora: the built-in `pystdlib` (the standard library's own
source, one example per file) and your own `files` (one per file, or per JSONL line), each with
~5% of its documents held out as the "validation" split by a hash of the document's key.
pwtrain/data/corpus.py builds and opens them.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import sysconfig
from typing import Any

import tensorflow_datasets as tfds

from pwtrain.errors import DataError

log = logging.getLogger(__name__)

BUILTIN = "pystdlib"
FILES = "files"  # your own text files: data.files

# Test suites hold deliberately odd files (bad encodings, huge generated data) and site-packages
# is not the standard library; neither is the text we want to model.
_SKIP_DIRS = frozenset({"__pycache__", "idle_test", "site-packages", "test", "tests"})

# The built-in corpus's held-out split: documents (files) whose key hashes below EVAL_FRACTION.
EVAL_SPLIT = "validation"
EVAL_FRACTION = 0.05


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_source_files(root: str, max_files: int = 0) -> list[str]:
  """Paths (relative to `root`) of the non-empty `.py` files under it, in a fixed order.

  Empty files (`__init__.py` mostly) are skipped: as documents they would only add EOS tokens.
  With `max_files > 0`, evenly spaced files of the sorted list are kept, because a prefix would
  be a few packages only (the first 400 are mostly `asyncio/` ... `encodings/` codec tables).
  """
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    for name in filenames:
      path = os.path.join(dirpath, name)
      if name.endswith(".py") and os.path.isfile(path) and os.path.getsize(path) > 0:
        paths.append(os.path.relpath(path, root))
  paths.sort()  # os.walk's order depends on the file system
  if 0 < max_files < len(paths):
    paths = [paths[i * len(paths) // max_files] for i in range(max_files)]
  return paths


def config_name(root: str, max_files: int) -> str:
  """The builder config name: everything that decides the content, so no stale build is reused.

  The stdlib is named by the exact Python version (its files change between releases); any
  other root by a hash of its absolute path.
  """
  if os.path.abspath(root) == os.path.abspath(stdlib_dir()):
    source = "py{}_{}_{}".format(*sys.version_info[:3])
  else:
    source = "dir_" + hashlib.sha1(os.path.abspath(root).encode()).hexdigest()[:12]
  return f"{source}_{f'files{max_files}' if max_files > 0 else 'all'}"


@dataclasses.dataclass(kw_only=True)
class PyStdlibConfig(tfds.core.BuilderConfig):
  root: str = ""
  max_files: int = 0


class PyStdlib(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """One example per source file: {'text': the file's bytes}.

  Constructed directly with a config made from `data.max_files`, so it needs no entry in TFDS's
  global name registry; skipping it also keeps a re-import of this module harmless.
  """

  name = BUILTIN
  # 1.1.0: a "validation" split of held-out files (before: "train" only).
  VERSION = tfds.core.Version("1.1.0")
  # No code directory with checksums or metadata files to look up. The lookup also breaks for
  # any builder inside a package unless the `importlib_resources` backport is installed.
  code_path = None

  # TFDS prints "Downloading and preparing dataset ..." and "... downloaded and prepared to"
  # through these two hooks (termcolor, to stdout); nothing is downloaded for a local build, so
  # they go to the DEBUG log. (Should TFDS rename the hooks, its two lines are printed again.)
  def _log_download_bytes(self) -> None:
    log.debug("building %s in %s", self.name, self.data_dir)

  def _log_download_done(self) -> None:
    log.debug("built %s in %s", self.name, self.data_dir)

  def _info(self) -> tfds.core.DatasetInfo:
    # Not `dataset_info_from_configs`: that reads README/CITATIONS files next to this module.
    return tfds.core.DatasetInfo(
      builder=self,
      description="The .py source files of the Python standard library, one per example.",
      features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is local
    documents = self._usable(self._documents())
    held_out = held_out_keys(list(documents), EVAL_FRACTION)
    splits = {"train": self._generate_examples(documents, lambda key: key not in held_out)}
    if held_out:  # a one-document corpus has no held-out split
      splits[EVAL_SPLIT] = self._generate_examples(documents, lambda key: key in held_out)
    return splits

  def _documents(self) -> dict[str, Any]:
    """{key: what `_read` takes}, in order: here each source file, keyed by its path."""
    paths = list_source_files(self.builder_config.root, self.builder_config.max_files)
    return {path: os.path.join(self.builder_config.root, path) for path in paths}

  def _usable(self, documents: dict[str, Any]) -> dict[str, Any]:
    """The documents that go into the splits: here all of them."""
    return documents

  def _read(self, key: str, where: Any) -> bytes:
    del key
    with open(where, "rb") as f:
      # Raw bytes, not str: a few files are not UTF-8, and the byte tokenizer wants bytes.
      return f.read()

  def _generate_examples(self, documents: dict, keep):
    for key, where in documents.items():
      if keep(key):
        text = self._read(key, where)
        if text is not None:  # a bad record that data.skip_bad_records skips
          yield key, {"text": text}


@dataclasses.dataclass(kw_only=True)
class LocalFilesConfig(tfds.core.BuilderConfig):
  paths: tuple[str, ...] = ()
  jsonl_field: str = "text"
  skip_bad_records: bool = False


class LocalFiles(PyStdlib, skip_registration=True):
  """Your own text (`data.dataset="files"`): each file matched by `data.files` is one document,
  except `.jsonl` files, whose lines are (field `data.jsonl_field` of each JSON object; blank
  lines skipped), keyed "<path>:<line number>". Held out for evaluation like the built-in
  corpus, by a hash of each document's key."""

  name = FILES
  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description="Local text files (data.files), one example per file or JSONL line.",
      features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )

  def _documents(self) -> dict[str, Any]:
    documents = {}
    for path in self.builder_config.paths:
      if not path.endswith(".jsonl"):
        documents[path] = path
        continue
      with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
          if line.strip():
            documents[f"{path}:{number}"] = line
    return documents

  def _usable(self, documents: dict[str, Any]) -> dict[str, Any]:
    """With data.skip_bad_records, the documents that read cleanly (the others are named in
    `skipped`). Decided before the held-out split, so a skipped record never leaves a split
    without examples."""
    if not self.builder_config.skip_bad_records:
      return documents
    good = {}
    for key, where in documents.items():
      _, why = self._parse(key, where)
      if why is None:
        good[key] = where
      else:
        self._skipped(key, why)
    return good

  def _parse(self, key: str, where: Any) -> tuple[bytes | None, str | None]:
    """(the document's text, None), or (None, why it is a bad record): a JSONL line without the
    text field, or, when skipping bad records, a file that is not UTF-8."""
    if isinstance(where, str):
      data = super()._read(key, where)
      if self.builder_config.skip_bad_records:
        try:
          data.decode("utf-8")
        except UnicodeDecodeError as e:
          return None, f"not UTF-8 ({e.reason} at byte {e.start})"
      return data, None
    try:
      text = json.loads(where)[self.builder_config.jsonl_field]
      if not isinstance(text, str):
        raise TypeError(f"is {type(text).__name__}")
    except (ValueError, KeyError, TypeError) as e:
      return None, f"{type(e).__name__}: {e}"
    return text.encode("utf-8"), None

  def _read(self, key: str, where: Any) -> bytes | None:
    """The document's text; None for a bad record that data.skip_bad_records skips (only a file
    changed since `_usable` read it)."""
    text, why = self._parse(key, where)
    if why is None:
      return text
    if self.builder_config.skip_bad_records:
      return self._skipped(key, why)
    raise DataError(
      f"data.files: line {key} is not a JSON object with a string field "
      f"data.jsonl_field={self.builder_config.jsonl_field!r} ({why}); fix or remove that line, "
      "or set data.skip_bad_records=True to skip such records"
    )

  def _skipped(self, key: str, why: str) -> None:
    self.__dict__.setdefault("skipped", []).append(f"{key} ({why})")
    return None


def held_out_keys(keys: list[str], fraction: float) -> set[str]:
  """The keys whose stable hash falls in the lowest `fraction` of the range: the documents
  kept out of training. Decided by each key alone (not by position or count), so a document
  stays on its side whatever else the corpus holds. With >= 2 keys both sides are non-empty:
  if the hash holds out none (or all), the lowest- (or highest-) hashing key moves over. A
  lone key is never held out: training needs it."""
  if len(keys) < 2:
    return set()
  scored = sorted(keys, key=_unit_hash)
  held = [k for k in scored if _unit_hash(k) < fraction]
  if not held:
    held = scored[:1]
  elif len(held) == len(keys):
    held = scored[:-1]
  return set(held)


def _unit_hash(key: str) -> float:
  """A key's SHA-1 as a number in [0, 1): stable across runs, machines and Python versions."""
  return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64


@contextlib.contextmanager
def quiet_tfds():
  """A local dataset is built without TFDS's chatter: its progress bars, and its warnings of a
  custom configuration and of a first build (absl's log, raised to ERROR while it builds). Its
  "preparing" lines are the builders' own (`PyStdlib._log_download_bytes`); its errors show."""
  tfds.disable_progress_bar()
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    absl_logger.setLevel(level)
