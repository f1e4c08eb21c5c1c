"""Text corpora as TFDS random-access sources: the built-in `pystdlib`, your own `files`, or any
prepared TFDS name.

`pystdlib` is a real TFDS dataset built (once, in seconds, offline) from the `.py` files of the
Python standard library this interpreter ships, so the default run needs no download; `files`
builds the local text or JSONL files matched by `data.files` the same way. Both hold out ~5% of
their documents as a "validation" split. Any other `data.dataset` must already be prepared in
`array_record` format; pwtrain never downloads. All are read with
`builder.as_data_source(split)`: random access is what lets Grain shuffle globally and
checkpoint a reader as a single index.
"""

import glob
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import tensorflow_datasets as tfds

from pwtrain.data.builders import (  # noqa: F401 - the builders' names, as corpus.X too
  BUILTIN,
  EVAL_FRACTION,
  EVAL_SPLIT,
  FILES,
  LocalFiles,
  LocalFilesConfig,
  PyStdlib,
  PyStdlibConfig,
  config_name,
  held_out_keys,
  list_source_files,
  quiet_tfds,
  stdlib_dir,
)
from pwtrain.errors import DataError

log = logging.getLogger(__name__)

# How many examples `check_source` reads to catch a wrong `data.text_key` or an all-empty corpus
# without scanning a large dataset; a corpus this small is checked exhaustively.
_NUM_CHECKED = 64


def prepare_files(data_cfg: Any, data_dir: str) -> LocalFiles:
  """Builds the files matched by `data.files` into `data_dir` unless that exact build exists
  (see `files_identity`)."""
  paths, name = files_identity(data_cfg)
  config = LocalFilesConfig(
    name=name,
    paths=tuple(paths),
    jsonl_field=data_cfg.jsonl_field,
    skip_bad_records=data_cfg.skip_bad_records,
  )
  with quiet_tfds():
    builder = LocalFiles(config=config, data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
      _check_writable(data_dir)
      builder.skipped = []
      builder.download_and_prepare()
      if builder.skipped:  # named once, when they are skipped
        shown = "; ".join(builder.skipped[:5])
        more = f"; and {len(builder.skipped) - 5} more" if len(builder.skipped) > 5 else ""
        log.warning(
          "data.skip_bad_records: skipped %d bad record(s) of data.files: %s%s",
          len(builder.skipped), shown, more,
        )  # fmt: skip
  return builder


def files_identity(data_cfg: Any) -> tuple[list[str], str]:
  """(the files `data.files` matches, sorted; the build's name): a hash of every file's path,
  size and modification time and of the JSONL field, so an edited, added or removed file makes
  another build (and another data stream)."""
  patterns = [p.strip() for p in str(data_cfg.files).split(",") if p.strip()]
  paths = sorted({os.path.abspath(p) for g in patterns for p in glob.glob(os.path.expanduser(g))})
  paths = [p for p in paths if os.path.isfile(p)]
  if not paths:
    raise DataError(
      f"data.files={data_cfg.files!r} matches no files (data.dataset={FILES!r} needs a glob, "
      f"or globs separated by commas, of text or .jsonl files)"
    )
  identity = hashlib.sha1(repr((data_cfg.jsonl_field, data_cfg.skip_bad_records)).encode())
  for path in paths:
    stat = os.stat(path)
    identity.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
  return paths, f"files_{identity.hexdigest()[:16]}"


def files_seen(data_cfg: Any) -> dict[str, str]:
  """{path: "<size> bytes, modified <ns>"} of the files `data.files` matches: what a resume
  compares to name the files that changed."""
  out = {}
  for path in files_identity(data_cfg)[0]:
    stat = os.stat(path)
    out[path] = f"{stat.st_size} bytes, modified {stat.st_mtime_ns}"
  return out


def prepare_pystdlib(data_dir: str, max_files: int = 0, root: str | None = None) -> PyStdlib:
  """Builds the `pystdlib` dataset into `data_dir` unless that build exists; returns its builder.

  `root` (default: this interpreter's stdlib) is there so that other local trees, e.g. an empty
  one in a test, can be built the same way.
  """
  root = stdlib_dir() if root is None else root
  config = PyStdlibConfig(name=config_name(root, max_files), root=root, max_files=max_files)
  with quiet_tfds():
    builder = PyStdlib(config=config, data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
      if not list_source_files(root, max_files):
        raise DataError(
          f"data.dataset={BUILTIN!r}: no non-empty .py files under {root!r} "
          f"(data.max_files={max_files}), so the corpus would be empty."
        )
      _check_writable(data_dir)
      builder.download_and_prepare()
  return builder


def open_source(data_cfg: Any, workdir: str, split: str | None = None) -> Sequence[dict[str, Any]]:
  """The random-access source named by `data.dataset` and `split` (default: `data.split`),
  checked to hold text."""
  data_dir = data_dir_for(data_cfg, workdir)
  if data_cfg.dataset == BUILTIN:
    builder = prepare_pystdlib(data_dir, data_cfg.max_files)
  elif data_cfg.dataset == FILES:
    builder = prepare_files(data_cfg, data_dir)
  else:
    builder = _prepared_builder(data_cfg.dataset, data_dir)
  split = data_cfg.split if split is None else split
  source = ReadableSource(_data_source(builder, data_cfg, split), builder, data_cfg, split)
  check_source(source, data_cfg, split)
  return source


class ReadableSource(Sequence):
  """A data source whose read errors (a damaged array_record file raises RuntimeError from
  deep inside the reader) become one ValueError naming the dataset's files and the fix."""

  def __init__(self, source: Sequence, builder: tfds.core.DatasetBuilder, data_cfg: Any, split):
    self.source = source
    self.files = os.path.join(os.fspath(builder.data_dir), f"*-{split.split('[')[0]}.*")
    if data_cfg.dataset in (BUILTIN, FILES):
      self.fix = f"delete {os.fspath(builder.data_dir)} and run again to rebuild it"
    else:
      self.fix = (
        f"rebuild it: `tfds build {data_cfg.dataset} --data_dir=... --file_format=array_record`"
      )
    self.dataset = data_cfg.dataset

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index):
    if isinstance(index, int) and not -len(self) <= index < len(self):
      raise IndexError(index)  # what iterating a Sequence stops at
    try:
      return self.source[index]
    except RuntimeError as e:
      reason = str(e).splitlines()[0][:200]
      raise DataError(
        f"data.dataset={self.dataset!r}: a file of {self.files} is damaged ({reason}); {self.fix}"
      ) from None


def data_dir_for(data_cfg: Any, workdir: str) -> str:
  return data_cfg.data_dir or os.path.join(workdir, "tfds")


def check_source(source: Sequence[dict[str, Any]], data_cfg: Any, split: str | None = None) -> None:
  """Raises ValueError for an empty source, a missing `data.text_key`, or only empty texts."""
  key = "data.split" if split is None or split == data_cfg.split else "data.eval_split"
  where = f"data.dataset={data_cfg.dataset!r}, {key}={split or data_cfg.split!r}"
  if len(source) == 0:
    raise DataError(f"The corpus is empty: {where} has no examples.")
  num_checked = min(len(source), _NUM_CHECKED)
  examples = [source[i * len(source) // num_checked] for i in range(num_checked)]
  key = data_cfg.text_key
  if key not in examples[0]:
    raise DataError(
      f"data.text_key={key!r} is not a feature of {where}; it has {sorted(examples[0])}."
    )
  if not any(len(example[key]) for example in examples):
    scope = "all" if num_checked == len(source) else f"{num_checked} evenly spaced"
    raise DataError(
      f"The corpus is empty: {scope} texts (data.text_key={key!r}) of {where} are empty."
    )


def _prepared_builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
  how = (
    f"Prepare it first (pwtrain never downloads), e.g. "
    f"`tfds build {name} --data_dir={data_dir} --file_format=array_record`, "
    f"or point data.data_dir at where it is prepared."
  )
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.DatasetNotFoundError as e:
    raise DataError(
      f"data.dataset={name!r} is neither {BUILTIN!r}, a known TFDS dataset, nor prepared in "
      f"data_dir {data_dir!r}. {how}"
    ) from e
  if not builder.is_prepared():
    raise DataError(
      f"data.dataset={name!r} is not prepared in data_dir {data_dir!r} "
      f"(looked in {os.fspath(builder.data_dir)!r}). {how}"
    )
  return builder


def _data_source(builder: tfds.core.DatasetBuilder, data_cfg: Any, split: str):
  splits = sorted(builder.info.splits)
  # Slices such as "train[:90%]" are fine; only the split's own name must exist.
  if split.split("[")[0] not in splits:
    key = "data.split" if split == data_cfg.split else "data.eval_split"
    why = ""
    if data_cfg.dataset in (BUILTIN, FILES) and split.split("[")[0] == EVAL_SPLIT:
      why = " (a corpus of one document holds none out: add files, or set train.eval_every=0)"
    raise DataError(
      f"{key}={split!r} is not a split of data.dataset={data_cfg.dataset!r}; it has {splits}{why}."
    )
  try:
    return builder.as_data_source(split)
  except NotImplementedError as e:  # prepared as TFRecord, which has no random access
    raise DataError(
      f"data.dataset={data_cfg.dataset!r} in {os.fspath(builder.data_dir)!r} is not in "
      f"array_record format, which random access needs; rebuild it with "
      f"`--file_format=array_record` into another data.data_dir."
    ) from e


def _check_writable(data_dir: str) -> None:
  # A probe file rather than os.access: os.access says yes to root even on read-only mounts.
  try:
    os.makedirs(data_dir, exist_ok=True)
    with tempfile.TemporaryFile(dir=data_dir):
      pass
  except OSError as e:
    raise DataError(
      f"data.data_dir={data_dir!r} is not writable, so the {BUILTIN!r} corpus cannot be built "
      f"there ({e}). Set data.data_dir to a writable directory (None means <workdir>/tfds)."
    ) from e
