"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import tempfile

from pwtrain import platforms  # imports no JAX

# XLA:CPU's LLVM passes at their lowest level (the HLO passes, fusion and layouts included, run
# as always): the tests' programs are tiny, so compiling is most of their time (~40% less at
# level 0). Every process the tests start inherits the flag, so the programs compared bitwise
# across processes are built alike; parity tolerances are unchanged.
# Each matmul runs on one thread (no Eigen thread pool): the tests' matrices are tiny, so
# splitting them costs more than it saves (~18% of a pods test), and the suite's two workers
# (pytest-xdist, pyproject.toml) and the processes tests start share two cores. Every process
# sums in the same order, so runs stay comparable bitwise across processes.
# XLA:CPU's reductions by XLA's own emitters, as every pwtrain command runs them
# (platforms.with_cpu_numerics: one float32 result per operation in every program).
os.environ["XLA_FLAGS"] = platforms.with_cpu_numerics(
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  + " --xla_cpu_multi_thread_eigen=false"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU runs a process's matmuls on a thread pool of max($NPROC or the cores, devices) threads,
# and how Eigen splits a long contraction (a weight gradient over many tokens) between threads
# decides the order of its sums. The same size in every process the tests start (remote workers
# of 2 devices, distributed processes of 2 or 4, this one of 8) makes their runs comparable
# bitwise, as on accelerators of one kind.
os.environ.setdefault("NPROC", "8")
# One XLA compilation cache per test session, inherited by the processes tests start (main runs,
# remote workers): many tests compile the same tiny programs (every train.run of the same small
# config, a worker's copy of a controller's program). A fresh directory each session, so nothing
# carries over between runs and every program is still compiled at least once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # pytest-xdist's workers inherit the session's
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="pwtrain_xla_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402
from helpers import load_config  # noqa: E402


@pytest.fixture
def tiny_config():
  return load_config("palm_tiny")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """A failed test's report ends with the last lines of each worker or process log under its
  tmp_path (remote workers' <workdir>/workers/*.log, pwtrain.launch's process<i>.log): a process
  that died mid-test says why only there, and tmp_path is gone by the time a CI log is read."""
  report = yield
  tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
  if report.failed and call.when == "call" and tmp_path is not None:
    logs = sorted(tmp_path.rglob("workers/*.log")) + sorted(tmp_path.rglob("process*.log"))
    for log in logs[:8]:
      lines = log.read_text(errors="replace").splitlines()[-40:]
      report.sections.append((f"tail of {log.relative_to(tmp_path)}", "\n".join(lines)))
  return report
