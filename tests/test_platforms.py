"""The platform is what JAX can initialise (pwtrain/platforms.py): a backend JAX finds is used
wherever it is, and only libtpu's attempt on a host without TPU chips is left out."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pwtrain import platforms

# A PJRT plugin as JAX discovers one (a module of the jax_plugins namespace whose initialize()
# registers a backend), standing in for a GPU plugin on a host pwtrain knows nothing about.
STAND_IN = """
def initialize():
  from jax._src import xla_bridge

  xla_bridge.register_backend_factory(
    "standin", xla_bridge.make_cpu_client, priority=500, fail_quietly=False
  )
"""

PROBE = """
import json, sys
from pwtrain import platforms

platforms.prepare()
import jax
from jax._src import xla_bridge

print(json.dumps({"backends": sorted(xla_bridge.backends()), "devices": len(jax.devices()),
                  "line": platforms.describe()}))
"""


@pytest.mark.parametrize(
  "environ,libtpu,chips,skip",
  [
    ({}, True, 0, True),  # libtpu installed, no chip: it would only print its errors
    ({}, True, 4, False),  # a TPU host
    ({}, False, 0, False),  # nothing to skip
    ({"JAX_PLATFORMS": "tpu"}, True, 0, False),  # the user's choice stands, and fails loudly
    ({"JAX_PLATFORMS": "cpu"}, True, 0, False),  # JAX never tries the TPU then
    ({"JAX_FORCE_TPU_INIT": "1"}, True, 0, False),  # JAX's own override
  ],
)
def test_the_tpu_backend_is_left_out_only_where_no_chip_is_attached(environ, libtpu, chips, skip):
  assert platforms.skip_tpu(environ, libtpu, chips) is skip


@pytest.mark.processes
def test_a_backend_jax_finds_is_used_and_libtpu_stays_quiet(tmp_path):
  """Without JAX_PLATFORMS, a plugin JAX discovers is initialised (a GPU behind /dev/dxg or any
  other node is not ruled out by a guess), the CPU has its simulated devices, the TPU backend is
  not tried on this chipless host (libtpu comes with the [tpu] extra the tests install), and the
  platform line says what was found."""
  plugin = tmp_path / "jax_plugins" / "standin"
  plugin.mkdir(parents=True)
  (plugin / "__init__.py").write_text(textwrap.dedent(STAND_IN))
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
  out = subprocess.run(
    [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-3000:]
  found = json.loads(out.stdout.strip().splitlines()[-1])
  assert "standin" in found["backends"] and "tpu" not in found["backends"], found
  assert found["devices"] == platforms.SIMULATED_CPU_DEVICES
  assert found["line"].startswith("platform: cpu, 8 devices (simulated on the CPU"), found
  assert "libtpu" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr, out.stderr


def test_a_device_count_the_user_set_is_kept_and_a_workers_replaces_it(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # nothing of JAX's registry is touched
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=3")
  numerics = [platforms.CPU_NUMERICS_FLAG]  # jaxlib 0.10.2 or later here
  platforms.prepare()
  assert os.environ["XLA_FLAGS"].split() == [
    "--xla_dump_to=/tmp/d",
    "--xla_force_host_platform_device_count=3",
    *numerics,
  ]
  platforms.prepare(cpu_devices=2)  # a remote island worker's --devices
  assert os.environ["XLA_FLAGS"].split() == [
    "--xla_dump_to=/tmp/d",
    *numerics,
    "--xla_force_host_platform_device_count=2",
  ]
  monkeypatch.setenv("XLA_FLAGS", "")
  platforms.prepare()
  assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", *numerics]


def test_the_cpu_numerics_flag_is_added_unless_named_or_unknown_to_the_installed_xla():
  """XLA:CPU's reductions by XLA's own emitters (platforms.CPU_NUMERICS_FLAG): added to the
  flags; a user's own setting of that flag kept; not given to a jaxlib outside 0.10.2-0.10.x, whose
  XLA might stop at a flag it does not know."""
  flag = platforms.CPU_NUMERICS_FLAG
  assert platforms.with_cpu_numerics(" --a=1 ", "0.10.2") == f"--a=1 {flag}"
  assert platforms.with_cpu_numerics("", "0.10.9") == flag
  assert platforms.with_cpu_numerics("--a=1", "0.11.0") == "--a=1"  # not checked there yet
  own = "--xla_cpu_experimental_ynn_fusion_type=+reduce"
  assert platforms.with_cpu_numerics(own, "0.10.2") == own
  assert platforms.with_cpu_numerics("--a=1", "0.10.1") == "--a=1"
  assert platforms.with_cpu_numerics("--a=1", "0.7.0") == "--a=1"
  # This process's (tests/conftest.py), as commands run; fails on a jaxlib the flag was not
  # checked with: measure there (experiments/rl_ops.py) and widen platforms' range.
  assert flag in os.environ["XLA_FLAGS"], "CPU_NUMERICS_FLAG not checked with this jaxlib"
