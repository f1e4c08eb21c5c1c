"""Remote island workers off loopback: TLS with self-signed certificates made here (openssl),
verified by the controller (backend.tls_ca); a worker refuses to serve off loopback without TLS
unless told --insecure. Workers bind 0.0.0.0 and the controller reaches them on 127.0.0.1."""

import os
import secrets
import shutil
import subprocess
import sys

import grpc
import jax
import numpy as np
import pytest
from helpers import REPO, random_batches, run_program, tiny_test_config

from pwtrain.backend.remote import auth
from pwtrain.backend.remote.client import WorkerClient
from pwtrain.errors import ConfigError

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="making a certificate needs openssl")
TOKEN = secrets.token_hex(16)


def make_certificate(directory, name: str) -> tuple[str, str]:
  """A self-signed certificate for localhost and 127.0.0.1, and its key (PEM paths)."""
  cert, key = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
  subprocess.run(
    [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    + ["-keyout", key, "-out", cert, "-subj", "/CN=localhost"]
    + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
    check=True,
    capture_output=True,
  )
  return cert, key


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tls")
  return make_certificate(directory, "worker"), make_certificate(directory, "stranger")


def start_worker(*flags: str) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "pwtrain.backend.remote.worker", "--island", "tls", "--devices"]
  return subprocess.Popen(
    [*cmd, "2", "--host", "0.0.0.0", *flags],
    cwd=REPO,
    env={**os.environ, auth.TOKEN_ENV: TOKEN},
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def ready_port(proc: subprocess.Popen) -> int:
  line = proc.stdout.readline()
  assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")
  return int(line.split()[1])


@pytest.fixture(scope="module")
def tls_worker(certificates):
  (cert, key), _ = certificates
  proc = start_worker("--tls_cert", cert, "--tls_key", key)
  try:
    yield f"127.0.0.1:{ready_port(proc)}"
  finally:
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.processes
def test_off_loopback_without_tls_is_refused_in_one_line():
  proc = start_worker()
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert err.strip().splitlines() == [
    "error: --host=0.0.0.0 is not a loopback address, and without TLS the token would cross "
    "the network in cleartext: give --tls_cert and --tls_key (the controller verifies them "
    "with backend.tls_ca), or --insecure to serve without TLS anyway"
  ]


@pytest.mark.processes
def test_insecure_serves_off_loopback_when_asked():
  proc = start_worker("--insecure")
  try:
    client = WorkerClient(f"127.0.0.1:{ready_port(proc)}", TOKEN, timeout_s=60)
    assert client.island == "tls"
    client.close()
  finally:
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_the_controller_verifies_the_worker_certificate(certificates, tls_worker):
  (cert, _), (stranger, _) = certificates
  client = WorkerClient(tls_worker, TOKEN, timeout_s=60, tls_ca=cert)
  assert (client.island, client.num_devices) == ("tls", 2)
  client.close()
  # Without TLS no call gets through; trusting another certificate is named in one line.
  with pytest.raises(grpc.RpcError) as e:
    WorkerClient(tls_worker, TOKEN, timeout_s=3)
  assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
  with pytest.raises(ConfigError, match=r"the TLS handshake fails \(.*CERTIFICATE_VERIFY_FAILED"):
    WorkerClient(tls_worker, TOKEN, timeout_s=3, tls_ca=stranger)


@pytest.mark.slow
def test_training_over_tls_equals_embedded(certificates, tls_worker):
  """Two steps on the TLS worker: the same losses and parameters as embedded mode, bitwise."""
  (cert, _), _ = certificates
  config = tiny_test_config()
  batches = random_batches(config, 2)
  _, want_metrics, want = run_program(config, batches, jax.devices()[:2])
  os.environ[auth.TOKEN_ENV] = TOKEN
  with config.unlocked():
    config.backend.mode = "remote"
    config.backend.workers = (tls_worker,)
    config.backend.tls_ca = cert
  _, metrics, state = run_program(config, batches, jax.devices()[:2])
  assert [float(m["loss"]) for m in metrics] == [float(m["loss"]) for m in want_metrics]
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_missing_tls_ca_names_the_key(tmp_path):
  from pwtrain import config as config_lib

  config = tiny_test_config()
  with config.unlocked():
    config.backend.mode = "remote"
    config.backend.workers = ("127.0.0.1:1",)
    config.backend.tls_ca = str(tmp_path / "nowhere.pem")
  with pytest.raises(ValueError, match=r"backend.tls_ca='.*nowhere.pem' is not a file"):
    config_lib.validate(config)
