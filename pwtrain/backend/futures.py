"""Futures of values the dispatcher already has, or of one output of a node's result."""

import concurrent.futures


def resolved(value) -> concurrent.futures.Future:
  """A future that is done, with `value`."""
  out: concurrent.futures.Future = concurrent.futures.Future()
  out.set_result(value)
  return out


def select(future: concurrent.futures.Future, index: int) -> concurrent.futures.Future:
  """A future for output `index` of a node's (tuple) result."""
  out: concurrent.futures.Future = concurrent.futures.Future()

  def done(f):
    if f.exception() is not None:
      out.set_exception(f.exception())
    else:
      value = f.result()
      out.set_result(value[index] if isinstance(value, tuple) else value)

  future.add_done_callback(done)
  return out
