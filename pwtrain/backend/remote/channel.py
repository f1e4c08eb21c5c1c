"""gRPC channel settings shared by the controller's clients and the workers' servers, and TLS.

A worker on a loopback address serves plain gRPC: nothing leaves the host. Off loopback the
shared token would cross the network in cleartext, so a worker there serves TLS with the
certificate and key it is given (`--tls_cert`, `--tls_key`), or refuses to start unless told
`--insecure`; the controller verifies the worker's certificate against `backend.tls_ca`.
"""

import ipaddress

import grpc

from pwtrain.backend.remote import arrays
from pwtrain.errors import ConfigError


def channel_options() -> list:
  """Message size limits: arrays travel in chunks of at most `arrays.MAX_MESSAGE_BYTES`."""
  return [
    ("grpc.max_send_message_length", arrays.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", arrays.MAX_MESSAGE_BYTES),
  ]


def is_loopback(host: str) -> bool:
  """Whether binding `host` keeps a server on this machine (127.0.0.0/8, ::1, localhost)."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False  # a host name: it may resolve to any interface


def _read(path: str, what: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise ConfigError(f"{what}={path!r} cannot be read: {e.strerror}") from None


def server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
  """TLS for a worker from PEM files: its certificate (chain) and private key."""
  cert = _read(cert_path, "--tls_cert")
  key = _read(key_path, "--tls_key")
  return grpc.ssl_server_credentials([(key, cert)])


def open_channel(address: str, tls_ca: str = "") -> grpc.Channel:
  """A channel to a worker: TLS verified against the PEM file `tls_ca` (the certificate
  authority, or the worker's own self-signed certificate) when given, else plain."""
  if not tls_ca:
    return grpc.insecure_channel(address, options=channel_options())
  credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "backend.tls_ca"))
  return grpc.secure_channel(address, credentials, options=channel_options())
