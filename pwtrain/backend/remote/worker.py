"""`python -m pwtrain.backend.remote.worker --island NAME --port P --devices N`: serve one island.

The token comes from $PWTRAIN_WORKER_TOKEN (or `--token_env`) or `--token_file`. The worker binds
127.0.0.1 unless `--host` says otherwise, prints `READY <port>` on stdout once it serves (port 0
picks a free one), and runs until a Shutdown RPC, SIGTERM or Ctrl-C. Off loopback it serves TLS
(`--tls_cert`, `--tls_key`: PEM files; the controller verifies with `backend.tls_ca`), or
refuses to start unless `--insecure` accepts a token in cleartext (channel.py).
"""

import argparse
import logging
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
  parser.add_argument("--tls_cert", default="", help="PEM certificate (chain) to serve TLS")
  parser.add_argument("--tls_key", default="", help="PEM private key of --tls_cert")
  parser.add_argument(
    "--insecure", action="store_true", help="serve without TLS off loopback (token in cleartext)"
  )
  args = parser.parse_args(argv)
  if bool(args.tls_cert) != bool(args.tls_key):
    sys.exit("error: --tls_cert and --tls_key go together: give both PEM files, or neither")
  from pwtrain import platforms

  platforms.prepare(args.devices or None)  # before JAX starts
  logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.island} %(message)s")

  from pwtrain.backend.remote import auth, channel, server

  if not args.tls_cert and not args.insecure and not channel.is_loopback(args.host):
    sys.exit(
      f"error: --host={args.host} is not a loopback address, and without TLS the token would "
      "cross the network in cleartext: give --tls_cert and --tls_key (the controller verifies "
      "them with backend.tls_ca), or --insecure to serve without TLS anyway"
    )
  try:
    token = auth.read_token(args.token_file, args.token_env)
    credentials = channel.server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
  except (OSError, ValueError) as e:
    sys.exit(f"error: {e}")
  server, worker, port = server.serve(
    args.island, token, args.host, args.port, credentials=credentials
  )
  signal.signal(signal.SIGTERM, lambda *_: worker.stopped.set())
  logging.info(
    "island %s: %d %s devices on %s:%d (%s)",
    args.island,
    len(worker.devices),
    worker.platform,
    args.host,
    port,
    "TLS" if credentials else "no TLS",
  )
  print(f"READY {port}", flush=True)
  try:
    worker.stopped.wait()
  except KeyboardInterrupt:
    pass
  server.stop(grace=1.0).wait()


if __name__ == "__main__":
  main()
