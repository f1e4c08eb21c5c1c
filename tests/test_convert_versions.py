"""The export (`pwtrain.convert to_hf`) read alike by transformers 4.46 and 5.x: each loads it
and computes pwtrain's logits, at the conversion tests' tolerance (max |d| <= 1e-4 in float32,
KL <= 1e-6), and reads its dtype.

The models, one of each family pwtrain exports that transformers 4.46 has (Qwen3 came in 4.51): a
Llama 3.1 (llama3 rope scaling, which 4.x reads from `rope_scaling` and would otherwise run as the
default rope), a Gemma, a Gemma 2 (soft caps, local and global layers, the query scale), a Mistral
(a sliding window on every layer) and a Qwen2 (q/k/v biases, tied embeddings), tiny and random
(tests/hf_models.py), imported, then exported. transformers 5 is the venv's, in this process; 4.46
runs tests/hf_read.py in an overlay environment that pip fills with transformers 4.46.3 and the
tokenizers and huggingface-hub it needs (downloaded once, kept under $PWTRAIN_TEST_CACHE, default
~/.cache/pwtrain/tests) and that takes everything else (torch, numpy, safetensors) from the venv.
That test is marked `network`: it downloads (14 MB, once). Measured on 2 loaded cores: the file
takes about 20 s of CPU with the environment built.
"""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import jax
import numpy as np
import pytest
from helpers import REPO
from hf_models import make_imported
from hf_read import read

from pwtrain import restore
from pwtrain import sample as sample_lib
from pwtrain.convert import exporter

pytestmark = pytest.mark.slow

# transformers 4.46's last release, and the pins of what it needs that the venv's 5.x outgrew.
TRANSFORMERS_4 = ("transformers==4.46.3", "tokenizers==0.20.3", "huggingface-hub==0.36.2")
FAMILIES = ("gemma", "gemma2", "llama", "mistral", "qwen2")


def overlay_python(pins) -> pathlib.Path:
  """The interpreter of a virtualenv with `pins` installed over this venv's packages (which it
  reads after its own, as this venv's site directory). Built once per pins, Python and venv,
  into a temporary directory renamed into place when complete; later calls reuse it."""
  base = sysconfig.get_path("purelib")
  key = hashlib.sha256(json.dumps([sys.version, base, pins]).encode()).hexdigest()[:12]
  root = pathlib.Path(
    os.environ.get("PWTRAIN_TEST_CACHE") or pathlib.Path.home() / ".cache/pwtrain/tests"
  )
  final = root / f"overlay-{key}"
  if (final / "bin" / "python").exists():
    return final / "bin" / "python"
  root.mkdir(parents=True, exist_ok=True)
  building = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=root))
  try:
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True, timeout=300)
    python = building / "bin" / "python"
    purelib = subprocess.run(
      [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
      check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # After the overlay's own site directory: this venv's (its .pth files processed too).
    pathlib.Path(purelib, "_pwtrain_base.pth").write_text(
      f"import site; site.addsitedir({base!r})\n"
    )
    pip = subprocess.run(
      [python, "-m", "pip", "install", "-q", *pins], capture_output=True, text=True, timeout=600
    )
    assert pip.returncode == 0, (
      f"pip install {' '.join(pins)} failed (it needs the network; `-m 'not network'` leaves "
      f"this test out): {pip.stderr[-2000:]}"
    )
    try:
      building.rename(final)
    except OSError:  # another session built it meanwhile
      pass
  finally:
    shutil.rmtree(building, ignore_errors=True)
  return final / "bin" / "python"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
  """{"tokens": int32 [2, 40], family: {"dir": its export, "logits": pwtrain's, float64}}."""
  out = {}
  for name in FAMILIES:
    root = tmp_path_factory.mktemp(name)
    imported = make_imported(name, root)
    model, run = imported.model, str(imported.run)
    config = sample_lib.load_config(None, run)
    exporter.to_hf(config, run, str(root / "export"), shard_size=10**9)
    if "tokens" not in out:  # one tokenizer, so one vocabulary, for every family
      rng = np.random.default_rng(0)
      out["tokens"] = rng.integers(0, model.config.vocab_size, (2, 40)).astype(np.int32)
    _, fns, params = sample_lib.restore_params(config, run, restore.reading_mesh(config))
    logits = jax.jit(lambda p, t, fns=fns: fns.module(p)(t))(params, out["tokens"])
    out[name] = {"dir": root / "export", "logits": np.asarray(logits, np.float64)}
  return out


@pytest.fixture(scope="module")
def read_by_4(exports, tmp_path_factory):
  """{family: hf_read.read of its export under transformers 4.46.3}, in one process."""
  python = overlay_python(TRANSFORMERS_4)
  scratch = tmp_path_factory.mktemp("read_by_4")
  np.save(scratch / "tokens.npy", exports["tokens"])
  pairs = [str(p) for name in FAMILIES for p in (exports[name]["dir"], scratch / f"{name}.npz")]
  proc = subprocess.run(
    [python, REPO / "tests" / "hf_read.py", scratch / "tokens.npy", *pairs],
    capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = {}
  for name in FAMILIES:
    with np.load(scratch / f"{name}.npz") as f:
      out[name] = {k: f[k] if k == "logits" else str(f[k]) for k in f.files}
  return out


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def assert_reads_as_pwtrain(reading, ours, version):
  """`reading` (hf_read.read's) is of transformers `version`, read float32, and its logits are
  `ours` within max |d| <= 1e-4 and KL(theirs || ours) <= 1e-6."""
  assert reading["version"].startswith(version), reading["version"]
  assert reading["dtype"] == "float32", reading["dtype"]
  theirs = reading["logits"]
  err = float(np.max(np.abs(ours - theirs)))
  assert err <= 1e-4, f"max |logits - pwtrain's| = {err:.3g}"
  p, q = _log_softmax(theirs), _log_softmax(ours)
  kl = float(np.max(np.sum(np.exp(p) * (p - q), axis=-1)))
  assert kl <= 1e-6, f"KL = {kl:.3g}"


@pytest.mark.network
@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_4_46_reads_the_export_as_pwtrain_runs_it(exports, read_by_4, name):
  assert_reads_as_pwtrain(read_by_4[name], exports[name]["logits"], "4.46.")


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_5_reads_the_export_as_pwtrain_runs_it(exports, name):
  reading = read(exports[name]["dir"], exports["tokens"])
  assert_reads_as_pwtrain(reading, exports[name]["logits"], "5.")
