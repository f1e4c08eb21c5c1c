"""pwtrain.config.load (the one config loader) and the Harness's own contract; the harness's
steps are exercised by every test that trains (helpers.run_program, train.run)."""

import jax
import pytest
from helpers import REPO, load_config, tiny_test_config

from pwtrain import config as config_lib
from pwtrain.harness import Harness

TINY_FILE = REPO / "configs" / "palm_tiny.py"


def test_load_applies_dotted_overrides_at_any_depth():
  config = config_lib.load(TINY_FILE, {"seed": 3, "parallel.data": 2, "optim.name": "sgd"})
  assert (config.seed, config.parallel.data, config.optim.name) == (3, 2, "sgd")
  assert config_lib.load(TINY_FILE) == load_config("palm_tiny")


def test_load_passes_the_arg_after_a_colon():
  # palm_8b builds on palm_tiny through base_config(..., arg): the arg reaches get_config.
  assert config_lib.load(f"{REPO / 'configs' / 'palm_8b.py'}:anything").model.num_layers == 32


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"model.num_layer": 2}, "config override 'model.num_layer': palm_tiny.py has no key"),
    ({"modle.num_layers": 2}, "config override 'modle.num_layers': palm_tiny.py has no section"),
    ({"seed.x": 2}, "palm_tiny.py has no section 'seed'"),
    ({"model.num_layers": "two"}, "config override model.num_layers='two'"),
  ],
)
def test_load_refuses_unknown_keys_and_wrong_types(overrides, message):
  with pytest.raises(ValueError, match=message):
    config_lib.load(TINY_FILE, overrides)


def test_load_names_a_missing_file():
  with pytest.raises(ValueError, match="no_such_config.py.*does not exist"):
    config_lib.load(REPO / "configs" / "no_such_config.py")


def test_harness_refuses_devices_with_a_cluster_and_trace_with_a_controller():
  config = tiny_test_config()
  with pytest.raises(ValueError, match="`devices` or a `cluster`"):
    Harness.build(config, [], cluster=object())
  with pytest.raises(ValueError, match="for a new controller"):
    Harness.build(config, controller=object(), trace=object())


def _run_saved(config, batches, saved_dir, caplog):
  """Builds `config` keeping its compiled pieces in `saved_dir` and runs `batches`: ({"loaded",
  "saved", "cached"}: how many pieces were loaded, traced and saved, traced and found in JAX's
  cache), host metrics, final host state)."""
  import re

  import jax

  caplog.clear()
  with caplog.at_level("INFO", logger="pwtrain.harness"):
    harness = Harness.build(config, saved_dir=str(saved_dir))
  with harness:
    state, metrics = harness.init(), []
    for i, batch in enumerate(batches):
      out = harness.step(state, batch, i)
      state, metrics = out.state, [*metrics, out.metrics]
    metrics = jax.device_get([m.result() for m in metrics])
    state = jax.device_get({k: v.result() for k, v in state.items()})
  found = re.search(r"pieces: (\d+) loaded .* (\d+) traced and saved, (\d+) traced", caplog.text)
  counts = dict(zip(("loaded", "saved", "cached"), map(int, found.groups()), strict=True))
  return counts, metrics, state


@pytest.fixture
def own_compile_cache(tmp_path):
  """A compilation cache of the test's own, empty: pieces the session's cache holds (every
  program other tests compiled) would be answered from it, and so not saved."""
  from jax.experimental.compilation_cache import compilation_cache as cc

  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
  cc.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  cc.reset_cache()


# Two pipeline stages whose B pieces trace from what tracing their F recorded (stage_remat="none").
_OWN = {
  "parallel.stages": 2,
  "parallel.islands": 2,
  "parallel.stage_remat": "none",
  "train.num_microbatches": 2,
  "model.d_ff": 96,
}


def test_a_build_loads_the_pieces_an_equal_build_saved_and_runs_them_alike(
  tmp_path, caplog, own_compile_cache
):
  """Harness.build(saved_dir=...) (backend/saved.py): a second build of the same config traces
  nothing and its steps equal the first's exactly; a changed config traces again; a build with a
  piece changed since it was saved is refused unread, traced whole and runs alike. Two pipeline
  stages: pieces on subsets of the devices, and B pieces that need their F traced first."""
  import pickle
  import zlib

  import numpy as np
  from helpers import random_batches

  config, pieces_dir = tiny_test_config(**_OWN), tmp_path / "pieces"
  batches = random_batches(config, 2)
  counts, metrics, state = _run_saved(config, batches, pieces_dir, caplog)
  pieces, files = counts["saved"], sorted(pieces_dir.glob("*.bin"))
  assert counts == {"loaded": 0, "saved": pieces, "cached": 0} and pieces > 2, caplog.text
  counts, again, again_state = _run_saved(config, batches, pieces_dir, caplog)
  assert counts == {"loaded": pieces, "saved": 0, "cached": 0}, caplog.text
  assert [m["loss"] for m in again] == [m["loss"] for m in metrics]
  for key in state:
    for a, b in zip(jax.tree.leaves(again_state[key]), jax.tree.leaves(state[key]), strict=True):
      np.testing.assert_array_equal(a, b)

  changed = config.copy_and_resolve_references()
  changed.optim.lr = config.optim.lr / 2
  counts = _run_saved(changed, batches[:1], pieces_dir, caplog)[0]
  assert counts["loaded"] == 0 and counts["saved"] + counts["cached"] == pieces, caplog.text

  # A piece's bytes replaced by a pickle that would run code (a shared cache, tampered with):
  # its MAC does not match, so it is refused unread, and the build is traced whole.
  marker = tmp_path / "ran"
  files[-1].write_bytes(zlib.compress(pickle.dumps(_Runs(str(marker)))))
  counts, after, _ = _run_saved(config, batches, pieces_dir, caplog)
  assert "did not load" in caplog.text and "MAC does not match" in caplog.text, caplog.text
  assert not marker.exists()
  assert counts["loaded"] == 0 and counts["saved"] + counts["cached"] == pieces, caplog.text
  assert [m["loss"] for m in after] == [m["loss"] for m in metrics]


class _Runs:
  """Unpickled, it would create the file `path`."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, "w"))


def test_the_cache_is_kept_within_its_cap_least_recently_used_builds_first(tmp_path):
  """backend/saved.evict: saved builds go, least recently built or loaded first (an unmarked one
  before any), until JAX's entries and the pieces together fit the cap; JAX's are left to it."""
  import os

  from pwtrain.backend import saved

  cache, pieces = tmp_path / "cache", tmp_path / "cache" / "pieces"
  pieces.mkdir(parents=True)
  (cache / "jit_step-abc-cache").write_bytes(b"x" * 400)  # one of JAX's entries
  for build, when in (("old", 100), ("new", 300), ("unmarked", None)):
    (pieces / f"{build}.p1.bin").write_bytes(b"x" * 200)
    (pieces / f"{build}.p1.json").write_bytes(b"{}")
    if when is not None:
      (pieces / f"{build}.build").write_bytes(b"")
      os.utime(pieces / f"{build}.build", (when, when))
  assert saved.evict(str(pieces), str(cache), max_bytes=700) == ["unmarked", "old"]
  assert sorted(p.name for p in pieces.iterdir()) == ["new.build", "new.p1.bin", "new.p1.json"]
  assert (cache / "jit_step-abc-cache").exists()
  assert saved.evict(str(pieces), str(cache), max_bytes=700) == []


def test_a_build_missing_a_saved_piece_is_traced_whole(tmp_path, caplog, own_compile_cache):
  """A piece gone from a complete build (found missing while building, before any compile ends):
  the build is traced whole, never half loaded and half traced, and runs alike."""
  from helpers import random_batches

  config, pieces_dir = tiny_test_config(**_OWN), tmp_path / "pieces"
  batches = random_batches(config, 1)
  counts, metrics, _ = _run_saved(config, batches, pieces_dir, caplog)
  assert counts["loaded"] == 0 and counts["saved"] > 2 and counts["cached"] == 0, caplog.text
  sorted(pieces_dir.glob("*.json"))[1].unlink()
  counts, after, _ = _run_saved(config, batches, pieces_dir, caplog)
  assert "did not load" in caplog.text and counts["loaded"] == 0, caplog.text
  assert [m["loss"] for m in after] == [m["loss"] for m in metrics]


def test_a_piece_from_jaxs_cache_is_not_saved(tmp_path, caplog, own_compile_cache):
  """An executable loaded from JAX's persistent cache does not serialize whole again (on XLA:CPU
  its copy fails at its first run): a build whose compiles JAX's cache answers saves nothing, and
  the next build of that config traces again and runs."""
  from helpers import random_batches

  config = tiny_test_config(**_OWN)
  batches = random_batches(config, 1)
  counts, metrics, _ = _run_saved(config, batches, tmp_path / "first", caplog)
  pieces = counts["saved"] + counts["cached"]  # pieces alike within the build: cached
  assert counts["saved"] > 0, caplog.text
  for _ in range(2):
    counts, again, _ = _run_saved(config, batches, tmp_path / "second", caplog)
    assert counts == {"loaded": 0, "saved": 0, "cached": pieces}, caplog.text
    assert [m["loss"] for m in again] == [m["loss"] for m in metrics]
