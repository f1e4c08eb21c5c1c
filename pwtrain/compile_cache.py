"""A run's compilation cache: JAX's persistent cache, and the compiled pieces saved beside it.

`of_run` makes JAX's persistent cache the run's while it runs: in train.compile_cache_dir (""
is <workdir>/compile_cache, unless the process has one already, e.g. from
$JAX_COMPILATION_CACHE_DIR; "off": none), every program cached however quickly it compiled (a
restart compiles nothing it compiled before), JAX's entries within train.compile_cache_max_bytes
(JAX's own LRU eviction). JAX keeps one cache per process (its settings are global, and it
opens the cache once), so the settings are put back after the run, and a second run in the
process (tests, notebooks) uses its own workdir's cache.

`pieces()` is where the run's compiled pieces are kept beside the cache's entries
(backend/saved.py), and `within_cap` keeps the two together under the cap, saved builds going
first.
"""

import contextlib
import os

import jax

from pwtrain.backend import saved


@contextlib.contextmanager
def of_run(train_cfg, workdir: str):
  """Within: JAX's persistent compilation cache is the run's (see the module doc)."""
  directory = train_cfg.compile_cache_dir
  if directory == "off" or (not directory and jax.config.jax_compilation_cache_dir):
    yield
    return
  from jax.experimental.compilation_cache import compilation_cache

  settings = {
    "jax_compilation_cache_dir": directory or os.path.join(workdir, "compile_cache"),
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
    "jax_compilation_cache_max_size": train_cfg.compile_cache_max_bytes or -1,
  }
  before = {key: getattr(jax.config, key) for key in settings}
  for key, value in settings.items():
    jax.config.update(key, value)
  compilation_cache.reset_cache()  # opened again, in the run's directory
  try:
    yield
  finally:
    for key, value in before.items():
      jax.config.update(key, value)
    compilation_cache.reset_cache()


def pieces() -> str | None:
  """Where the compiled pieces are kept, so that a start with the same config and code loads
  them without tracing (backend/saved.py): beside the compilation cache's entries, if there is
  one."""
  cache = jax.config.jax_compilation_cache_dir
  return os.path.join(cache, "pieces") if cache else None


def within_cap(train_cfg) -> None:
  """After a build: the cache's entries and the saved pieces together within
  train.compile_cache_max_bytes (0: no cap), the least recently used saved builds removed
  first (backend/saved.evict)."""
  directory = pieces()
  if train_cfg.compile_cache_max_bytes and directory is not None:
    saved.evict(directory, jax.config.jax_compilation_cache_dir, train_cfg.compile_cache_max_bytes)
