"""gRPC channel settings shared by the controller's clients and the workers' servers."""

from pwtrain.backend.remote import arrays


def channel_options() -> list:
  """Message size limits: arrays travel in chunks of at most `arrays.MAX_MESSAGE_BYTES`."""
  return [
    ("grpc.max_send_message_length", arrays.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", arrays.MAX_MESSAGE_BYTES),
  ]
