"""`python -m pwtrain.backend.remote.worker --island NAME --port P --devices N`: serve one island.

The token comes from $PWTRAIN_WORKER_TOKEN (or `--token_env`) or `--token_file`. The worker binds
127.0.0.1 unless `--host` says otherwise, prints `READY <port>` on stdout once it serves (port 0
picks a free one), and runs until a Shutdown RPC, SIGTERM or Ctrl-C.
"""

import argparse
import logging
import os
import re
import signal
import sys


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--island", required=True)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--devices", type=int, default=0, help="simulated CPU devices (0: as is)")
  parser.add_argument("--token_file", default="")
  parser.add_argument("--token_env", default="PWTRAIN_WORKER_TOKEN")
  args = parser.parse_args(argv)
  if args.devices:
    # Read when JAX first creates its CPU backend, which nothing has done yet.
    flags = re.sub(
      r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.island} %(message)s")

  from pwtrain.backend.remote import auth, server

  try:
    token = auth.read_token(args.token_file, args.token_env)
  except (OSError, ValueError) as e:
    sys.exit(f"error: {e}")
  server, worker, port = server.serve(args.island, token, args.host, args.port)
  signal.signal(signal.SIGTERM, lambda *_: worker.stopped.set())
  logging.info(
    "island %s: %d %s devices on %s:%d",
    args.island,
    len(worker.devices),
    worker.platform,
    args.host,
    port,
  )
  print(f"READY {port}", flush=True)
  try:
    worker.stopped.wait()
  except KeyboardInterrupt:
    pass
  server.stop(grace=1.0).wait()


if __name__ == "__main__":
  main()
