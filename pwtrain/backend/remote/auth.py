"""The shared token every RPC must carry, and the server interceptor that checks it.

Workers and the controller read the same secret from an environment variable or a file; it is
sent as gRPC metadata and compared in constant time. A refused call is logged with its peer.
"""

import hmac
import logging
import os

import grpc

from pwtrain.errors import ConfigError

TOKEN_ENV = "PWTRAIN_WORKER_TOKEN"
_METADATA_KEY = "pwtrain-token"


def read_token(token_file: str = "", env: str = TOKEN_ENV) -> str:
  """The token from `token_file` if given, else from the environment variable `env`."""
  if token_file:
    with open(os.path.expanduser(token_file)) as f:
      token = f.read().strip()
    source = f"file {token_file!r}"
  else:
    token = os.environ.get(env, "").strip()
    source = f"environment variable {env}"
  if len(token) < 16:
    raise ConfigError(
      f"remote islands need a shared token of at least 16 characters from the {source} "
      "(e.g. `export PWTRAIN_WORKER_TOKEN=$(openssl rand -hex 16)`)"
    )
  return token


def call_metadata(token: str) -> tuple:
  return ((_METADATA_KEY, token),)


class TokenInterceptor(grpc.ServerInterceptor):
  """Refuses (UNAUTHENTICATED) every call without the right token, before any handler runs."""

  def __init__(self, token: str):
    self._token = token.encode()

    def refuse(request, context):
      logging.warning("refused a call from %s: missing or wrong token", context.peer())
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong pwtrain token")

    self._refuse = refuse

  def intercept_service(self, continuation, handler_call_details):
    given = dict(handler_call_details.invocation_metadata or ()).get(_METADATA_KEY, "")
    if hmac.compare_digest(given.encode(), self._token):
      return continuation(handler_call_details)
    handler = continuation(handler_call_details)
    # Answer in the handler's own shape (unary or streamed request), without calling it.
    if handler is None:
      return None
    if handler.request_streaming and handler.response_streaming:
      return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._refuse(None, ctx))
    if handler.request_streaming:
      return grpc.stream_unary_rpc_method_handler(lambda it, ctx: self._refuse(None, ctx))
    if handler.response_streaming:
      return grpc.unary_stream_rpc_method_handler(self._refuse)
    return grpc.unary_unary_rpc_method_handler(self._refuse)
