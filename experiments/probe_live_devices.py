"""Probe: does JAX's fault-tolerant multi-controller runtime work on CPU here?

Run (about 1-2 minutes per process count on 2 cores):
  python experiments/probe_live_devices.py
  python experiments/probe_live_devices.py --n=3 --no-rejoin --heartbeat_s=4

For each process count N (--n, default 2 and 3), the parent starts N worker processes of this
script on loopback (coordinator on a free port; 2 simulated CPU devices each), every one with
`jax_enable_recoverability` set and a short heartbeat timeout, then:
  baseline  each process: jax.distributed.initialize, a local computation, a pull ring over
            jax.experimental.transfer (as pwtrain/backend/pulls.py), a cross-host device_put
            from process 0 to 1, one computation over a mesh of every process's devices (gloo),
            and one `live_devices(jax.devices())` block
  kill      the parent SIGKILLs process N-1
  survive   the others: `live_devices` until it drops process N-1 (how long that took after the
            kill), (a) a local computation, (b) with N >= 3 a pull and a device_put between
            processes 0 and 1, (c) a computation over a mesh of the survivors' devices only
            (the devices of a baseline step, and with N >= 3 a set no step used before), (e) a
            pull from the dead process, (f, --mesh_with_dead) a computation over every device
  rejoin    (--rejoin) the parent starts a replacement process with id N-1; every process calls
            `live_devices` until it includes N-1, then pulls from the replacement to process 0
            and back, a barrier of every process on a fresh id, the replacement setting a key
            its predecessor set and entering a barrier its predecessor passed, and one
            computation over every process's devices
  exit      (d) jax.distributed.shutdown and process exit (how long, exit status)
Each step prints `PROBE n<N>/p<i>/<step>: ok|FAILED <error first line> (<seconds>)` (p<i>r: the
replacement); the parent prints them as they come and a summary at the end. Every wait has a
timeout, and the parent kills what is left, so the script always finishes. Workers' stderr goes
to a temporary folder, named at the end (the last fatal lines of a dead worker are shown).
"""

import argparse
import datetime
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

DEVICES = 2  # simulated CPU devices per process


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return f"{type(e).__name__}: {text.splitlines()[0][:240] if text else ''}"


# ---------------------------------------------------------------------------------------------
# Worker side.


class Probe:
  """Runs steps with a timeout each (in a daemon thread: a call stuck in C++ cannot be
  interrupted, so a timed-out step is left behind) and prints one PROBE line per step."""

  def __init__(self, tag: str):
    self.tag = tag

  def __call__(self, name: str, fn, timeout_s: float):
    box = {}

    def run():
      try:
        box["value"] = fn()
      except BaseException as e:
        box["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    took = time.monotonic() - start
    if thread.is_alive():
      self.say(name, f"FAILED timeout: still blocked after {timeout_s:.0f} s", took)
      return False, None
    if "error" in box:
      self.say(name, f"FAILED {_first_line(box['error'])}", took)
      return False, None
    value = box.get("value")
    detail = value[1] if isinstance(value, tuple) else value
    self.say(name, "ok" + (f" {detail}" if detail else ""), took)
    return True, value[0] if isinstance(value, tuple) else value

  def say(self, name: str, outcome: str, took: float) -> None:
    print(f"PROBE {self.tag}/{name}: {outcome} ({took:.1f}s)", flush=True)


def worker(args) -> None:
  # A last resort: whatever hangs, this process ends.
  killer = threading.Timer(args.case_timeout_s + 30, lambda: os._exit(3))
  killer.daemon = True
  killer.start()

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils, transfer
  from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
  from jax.sharding import PartitionSpec as P

  i, n, hb = args.worker, args.num, args.heartbeat_s
  gen = 1 if args.replacement else 0
  victim = n - 1
  probe = Probe(f"n{n}/p{i}{'r' if gen else ''}")
  jax.config.update("jax_enable_recoverability", args.recoverability)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{_free_port()}")

  def init():
    jax.distributed.initialize(
      f"127.0.0.1:{args.port}",
      n,
      i,
      initialization_timeout=60,
      heartbeat_timeout_seconds=hb,
      shutdown_timeout_seconds=15,
    )
    return f"{len(jax.devices())} devices, {len(jax.local_devices())} local"

  ok, _ = probe("init", init, 75)
  if not ok:
    print("ABORT", flush=True)
    os._exit(1)
  client = jax._src.distributed.global_state.client
  state = {}

  def server():
    device = jax.local_devices()[0]
    state["server"] = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
    state["connections"] = {}
    client.key_value_set(f"probe/server/{i}/{gen}", state["server"].address())

  def local():
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("x",))
    host = np.arange(8.0 * len(devices), dtype=np.float32)
    x = jax.device_put(host, NamedSharding(mesh, P("x")))
    got = float(jax.jit(lambda v: (v * v).sum())(x))
    assert got == float((host * host).sum()), got

  def pull(src: int, dst: int, uuid: int, src_gen: int = 0):
    """`src` offers an array under `uuid`, `dst` pulls it (others do nothing)."""
    value = np.arange(16, dtype=np.float32) + uuid
    if i == src:
      offered = jax.device_put(value, jax.local_devices()[0])
      state.setdefault("offered", []).append(offered)  # kept alive until pulled
      state["server"].await_pull(uuid, offered)
      return "offered"
    if i != dst:
      return "not involved"
    connections = state["connections"]
    if (src, src_gen) not in connections:
      address = client.blocking_key_value_get(f"probe/server/{src}/{src_gen}", 20_000)
      connections[(src, src_gen)] = state["server"].connect(address)
    spec = jax.ShapeDtypeStruct(
      value.shape, value.dtype, sharding=SingleDeviceSharding(jax.local_devices()[0])
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=20)
    got = connections[(src, src_gen)].pull(uuid, spec, timeout=deadline)
    assert np.array_equal(np.asarray(got), value), np.asarray(got)
    return f"pulled from p{src}"

  def device_put(src: int, dst: int, salt: float):
    """A cross-host jax.device_put of an array on `src`'s first device to `dst`'s."""
    value = np.arange(16, dtype=np.float32) + salt
    on_src = SingleDeviceSharding(jax.local_devices(process_index=src)[0])
    on_dst = SingleDeviceSharding(jax.local_devices(process_index=dst)[0])
    if i == src:
      x = jax.device_put(value, on_src)
    else:
      x = jax.make_array_from_single_device_arrays(value.shape, on_src, [], dtype=value.dtype)
    y = jax.device_put(x, on_dst)
    # The sender's side runs in the background: it is done once the receiver says so.
    key = f"probe/device_put/{salt}"
    if i == dst:
      got = np.asarray(y.addressable_shards[0].data)
      assert np.array_equal(got, value), got
      client.key_value_set(key, "received")
      return f"received from p{src}"
    client.blocking_key_value_get(key, 25_000)
    return f"sent to p{dst}"

  def mesh_sum(procs, first_only: bool = False):
    """One jitted sum over a mesh of the devices of processes `procs` (a collective over
    gloo when they are several); `first_only`: only each process's first device (a set of
    devices, hence a gloo context, that no earlier step used)."""
    devices = [d for d in jax.devices() if d.process_index in procs]
    if first_only:
      devices = [jax.local_devices(process_index=k)[0] for k in sorted(procs)]
    mesh = Mesh(np.array(devices), ("x",))
    host = np.arange(4.0 * len(devices), dtype=np.float32)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda k: host[k])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    got = float(np.asarray(total.addressable_shards[0].data))
    assert got == float(host.sum()), got
    return f"over processes {sorted(procs)}"

  def live(want, timeout_s: float, since: float | None = None):
    """`live_devices(jax.devices())` blocks (empty bodies) until the processes yielded satisfy
    `want`; the detail lists each block's yield (or its ProcessFailureError)."""
    attempts = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      procs = None
      try:
        with multihost_utils.live_devices(jax.devices()) as devices:
          procs = sorted({d.process_index for d in devices})
      except multihost_utils.ProcessFailureError as e:
        failed = sorted({d.process_index for d in e.failed_devices})
        attempts.append(f"{procs}->ProcessFailureError(processes {failed})")
        continue
      attempts.append(f"{procs}")
      if want(procs):
        after = f", {time.time() - since:.1f}s after the kill" if since else ""
        return procs, f"yields {' '.join(attempts)}{after}"
      time.sleep(0.2)
    raise TimeoutError(f"live_devices yields {' '.join(attempts)}")

  everyone = set(range(n))
  if not gen:
    probe("transfer_server", server, 30)
    probe("baseline_local", local, 60)
    # A ring of pulls: process i offers to i+1, then pulls from i-1.
    probe("baseline_offer_ring", lambda: pull(i, (i + 1) % n, 100 + (i + 1) % n), 30)
    probe("baseline_pull_ring", lambda: pull((i - 1) % n, i, 100 + i), 45)
    if i in (0, 1):
      probe("baseline_device_put_0to1", lambda: device_put(0, 1, 0.5), 45)
    probe("baseline_mesh_all", lambda: mesh_sum(everyone), 60)
    if n >= 3 and i < n - 1:  # the survivors-to-be, on a mesh of theirs before the kill
      probe("baseline_mesh_survivors", lambda: mesh_sum(everyone - {victim}), 45)
    probe("baseline_barrier", lambda: client.wait_at_barrier("probe/barrier/all", 30_000), 35)
    probe("baseline_live_devices", lambda: live(lambda p: p == sorted(everyone), 30), 35)
    print("READY", flush=True)
    command = sys.stdin.readline().split()
    if i == victim:  # waits to be killed
      time.sleep(args.case_timeout_s)
      os._exit(0)
    if not command or command[0] != "killed":
      print("ABORT", flush=True)
      os._exit(1)
    killed_at = float(command[1])
    ok, _ = probe(
      "live_after_kill",
      lambda: live(lambda p: victim not in p, 3 * hb + 30, since=killed_at),
      3 * hb + 35,
    )
    survivors = everyone - {victim}
    probe("a_local_after_kill", local, 45)
    if n >= 3:
      probe("b_pull_0to1_after_kill", lambda: pull(0, 1, 200), 30)
      probe("b_pull_1to0_after_kill", lambda: pull(1, 0, 201), 30)
      probe("b_device_put_0to1_after_kill", lambda: device_put(0, 1, 2.5), 30)
    probe("c_mesh_survivors_after_kill", lambda: mesh_sum(survivors), 30)
    if n >= 3:
      probe("c_mesh_survivors_fresh_after_kill", lambda: mesh_sum(survivors, True), 30)
    # A pull from the dead process (p0 pulled from it in the baseline ring): fails or hangs?
    probe("e_pull_from_dead", lambda: pull(victim, 0, 400), 25)
    if args.mesh_with_dead:  # a collective over every device, the dead process's included
      probe("f_mesh_with_dead", lambda: mesh_sum(everyone), 20)
    print("SURVIVED", flush=True)
    command = sys.stdin.readline().split()
  else:
    probe("transfer_server", server, 30)
    command = ["rejoin"]

  if command and command[0] == "rejoin":
    probe("rejoin_live_devices", lambda: live(lambda p: victim in p, 60), 65)
    probe("rejoin_pull_new_to_0", lambda: pull(victim, 0, 300, src_gen=1), 30)
    # What a rejoin's handover needs (--rejoin): the survivors' state pulled by the
    # replacement, a barrier of every process on a fresh id, and what the replacement meets
    # where it repeats its predecessor's calls (a key it set, a barrier it passed).
    probe("rejoin_pull_0_to_new", lambda: pull(0, victim, 301), 30)
    probe(
      "rejoin_barrier_fresh",
      lambda: client.wait_at_barrier("probe/rejoined", 20_000, process_ids=sorted(everyone)),
      25,
    )
    if gen:
      probe(
        "rejoin_kv_set_predecessors_key",
        lambda: client.key_value_set(f"probe/server/{i}/0", state["server"].address()),
        15,
      )
      probe(
        "rejoin_barrier_passed_before",
        lambda: client.wait_at_barrier("probe/barrier/all", 10_000),
        15,
      )
    probe("rejoin_mesh_fresh", lambda: mesh_sum(everyone, True), 30)
    # The baseline's set of devices again: last, since it may leave a process stuck.
    probe("rejoin_mesh_all", lambda: mesh_sum(everyone), 20)
    print("REJOINED", flush=True)
    command = sys.stdin.readline().split()

  probe("d_shutdown", jax.distributed.shutdown, 30)
  print("EXITING", flush=True)
  sys.stdout.flush()
  # The interpreter's own exit (atexit handlers, C++ destructors) is timed by the parent.


# ---------------------------------------------------------------------------------------------
# Parent side.


class Worker:
  def __init__(self, args, i: int, n: int, port: int, logdir: str, lines, replacement=False):
    self.tag = f"n{n}/p{i}{'r' if replacement else ''}"
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
      PYTHONUNBUFFERED="1",
    )
    self.log_path = os.path.join(logdir, self.tag.replace("/", "_") + ".log")
    self.log = open(self.log_path, "w")  # closed in case()
    command = [
      sys.executable,
      os.path.abspath(__file__),
      f"--worker={i}",
      f"--num={n}",
      f"--port={port}",
      f"--heartbeat_s={args.heartbeat_s}",
      f"--case_timeout_s={args.case_timeout_s}",
      "--recoverability" if args.recoverability else "--no-recoverability",
      *(["--mesh_with_dead"] if args.mesh_with_dead else []),
    ]
    if replacement:
      command.append("--replacement")
    self.popen = subprocess.Popen(
      command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
    )
    self.markers: set[str] = set()
    self.eof = False
    threading.Thread(target=self._read, args=(lines,), daemon=True).start()

  def _read(self, lines) -> None:
    for line in self.popen.stdout:
      lines.put((self, line.rstrip("\n")))
    lines.put((self, None))

  def send(self, line: str) -> None:
    try:
      self.popen.stdin.write(line + "\n")
      self.popen.stdin.flush()
    except (OSError, ValueError):
      pass

  def fatal_lines(self) -> list[str]:
    with open(self.log_path) as f:
      lines = [x.strip() for x in f if x[:1] in "EF" and x[1:5].isdigit()]
    return lines[-2:]


def parent(args) -> None:
  counts = [int(x) for x in args.n.split(",")]
  logdir = tempfile.mkdtemp(prefix="probe_live_devices_")
  summary = []
  for n in counts:
    summary += case(args, n, logdir)
  print("\n===== summary =====")
  print(
    f"jax_enable_recoverability={args.recoverability}, heartbeat_timeout_seconds="
    f"{args.heartbeat_s}, {DEVICES} CPU devices per process; worker logs in {logdir}"
  )
  for line in summary:
    print(line)


def case(args, n: int, logdir: str) -> list[str]:
  lines: queue.Queue = queue.Queue()
  port = _free_port()
  start = time.monotonic()
  workers = [Worker(args, i, n, port, logdir, lines) for i in range(n)]
  out: list[str] = []

  def wait(group, marker: str, timeout_s: float) -> bool:
    deadline = min(time.monotonic() + timeout_s, start + args.case_timeout_s)
    while True:
      if all(marker in w.markers or w.eof for w in group):
        return all(marker in w.markers for w in group)
      try:
        w, line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
      except queue.Empty:
        if time.monotonic() >= deadline:
          late = [w.tag for w in group if marker not in w.markers]
          out.append(f"PROBE n{n}/parent/wait_{marker}: FAILED timeout, waiting for {late}")
          print(out[-1], flush=True)
          return False
        continue
      if line is None:
        w.eof = True
      elif line.startswith("PROBE "):
        out.append(line)
        print(line, flush=True)
      elif line.strip() in ("READY", "SURVIVED", "REJOINED", "EXITING", "ABORT"):
        w.markers.add(line.strip())
        if line.strip() == "ABORT":
          w.eof = True

  def timed(name: str, ok: bool, took: float, detail: str = "") -> None:
    outcome = "ok" if ok else "FAILED"
    out.append(f"PROBE n{n}/parent/{name}: {outcome}{' ' + detail if detail else ''} ({took:.1f}s)")
    print(out[-1], flush=True)

  try:
    if not wait(workers, "READY", 90):
      return out
    victim = workers[-1]
    victim.popen.send_signal(signal.SIGKILL)
    killed_at = time.time()
    survivors = workers[:-1]
    for w in survivors:
      w.send(f"killed {killed_at}")
    t = time.monotonic()
    survived = wait(survivors, "SURVIVED", 3 * args.heartbeat_s + 75)
    dead = [w.tag for w in survivors if w.eof and "SURVIVED" not in w.markers]
    timed("survivors_alive", survived and not dead, time.monotonic() - t, f"dead: {dead}")
    alive = [w for w in survivors if not w.eof]
    if args.rejoin and alive:
      replacement = Worker(args, n - 1, n, port, logdir, lines, replacement=True)
      workers.append(replacement)
      for w in alive:
        w.send("rejoin")
      alive.append(replacement)
      wait(alive, "REJOINED", 80)
    # Process 0 (which serves the coordination service) leaves last.
    alive = [w for w in alive if not w.eof]
    for group in ([w for w in alive if w is not workers[0]], [w for w in alive if w is workers[0]]):
      t = time.monotonic()
      for w in group:
        w.send("exit")
      wait(group, "EXITING", 40)
      for w in group:
        name = f"{w.tag[len(f'n{n}/') :]}_exit"
        try:
          rc = w.popen.wait(timeout=max(1.0, t + 45 - time.monotonic()))
          timed(name, rc == 0, time.monotonic() - t, f"rc={rc}")
        except subprocess.TimeoutExpired:
          timed(name, False, time.monotonic() - t, "hung, killed")
  finally:
    for w in workers:
      if w.popen.poll() is None:
        w.popen.kill()
      try:
        w.popen.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
      w.log.close()
      if w.popen.returncode not in (0, -signal.SIGKILL) or w is workers[n - 1]:
        for fatal in w.fatal_lines():
          out.append(f"  {w.tag} rc={w.popen.returncode} log: {fatal[:300]}")
  out.append(f"  n={n} took {time.monotonic() - start:.0f}s")
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", default="2,3", help="process counts to probe, comma-separated")
  parser.add_argument("--heartbeat_s", type=int, default=5)
  parser.add_argument("--case_timeout_s", type=float, default=150)
  parser.add_argument("--rejoin", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--recoverability", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument(
    "--mesh_with_dead",
    action="store_true",
    help="after the kill, also run a computation over every device (the dead ones included)",
  )
  parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
  parser.add_argument("--num", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker >= 0:
    worker(args)
  else:
    parent(args)


if __name__ == "__main__":
  main()
