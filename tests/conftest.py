"""Shared fixtures. Everything here runs on a machine without a GPU."""

import os

# The GPU interpreter runs each warpgroup as its own XLA CPU computation that
# blocks in barrier waits; XLA's CPU thread pool, sized by NPROC (default: the
# core count), must hold them all at once or a kernel deadlocks at random on
# a 2-core machine (`fa4_jax.interpret`). Set before any backend starts.
os.environ.setdefault("NPROC", "32")

# Under pytest-xdist (the README's `-n 2`) several processes may share one GPU:
# each takes its share of the memory instead of XLA's default 75 %.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / _workers:.2f}")

import jax  # noqa: E402
import pytest

from fa4_jax import testing

# Sharding tests need several devices; on the CPU XLA can pretend. This must
# run before any JAX backend starts, which is why it sits at import time here.
HOST_DEVICES = 8
testing.force_host_devices(HOST_DEVICES)
# float32 comparisons are meant exactly; on a GPU the default would be TF32.
jax.config.update("jax_default_matmul_precision", "highest")

ON_GPU = jax.devices()[0].platform == "gpu"
cpu_only = pytest.mark.skipif(ON_GPU, reason="describes a machine without a GPU")


def pytest_addoption(parser):
  parser.addoption(
      "--kernels-on-gpu", action="store_true",
      help="run the kernels of the interpreter tests on this machine's GPU instead of "
           "the interpreter (no race detection): the same small, odd cases on hardware")


def pytest_collection_modifyitems(config, items):
  """With `--kernels-on-gpu`, only the tests that run kernels interpreted."""
  if not config.getoption("--kernels-on-gpu"):
    return
  chosen = [item for item in items if "run_interpreted" in getattr(item, "fixturenames", ())]
  config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
  items[:] = chosen


@pytest.fixture
def run_interpreted(request):
  """`run_interpreted(fn, *args)`: fn under the GPU interpreter, no races allowed.

  With `--kernels-on-gpu`, fn runs on the GPU instead: the interpreter's cases
  (odd lengths, tiny grids, work queues of a few CTAs) then meet the hardware's
  real concurrency and its real atomics. Blackwell cases skip off Blackwell.
  """
  if not request.config.getoption("--kernels-on-gpu"):
    return testing.run_interpreted
  if not ON_GPU:
    pytest.skip("--kernels-on-gpu needs a GPU")
  major = str(jax.devices()[0].compute_capability).split(".")[0]
  if "sm100" in request.node.nodeid and major != "10":
    pytest.skip("a Blackwell kernel, and this GPU is not sm_100")
  return _run_on_gpu


def _run_on_gpu(fn, *args, detect_races=True, **kwargs):
  del detect_races  # the hardware has no race detector
  return jax.block_until_ready(fn(*args, **kwargs))


@pytest.fixture
def cross_lower():
  """`cross_lower(fn, *specs, arch="sm_90"|"sm_100")` -> testing.LoweredKernels."""
  return testing.cross_lower


@pytest.fixture
def host_devices():
  """The forced CPU devices, for sharding tests.

  Meshes are built from the default backend's devices, so these tests need
  the CPU to be the default: on a one-GPU machine they are skipped (run them
  there with JAX_PLATFORMS=cpu).
  """
  devices = jax.devices()
  if len(devices) < HOST_DEVICES:
    pytest.skip(f"needs {HOST_DEVICES} devices of the default backend; "
                f"{devices[0].platform} has {len(devices)} (try JAX_PLATFORMS=cpu)")
  return devices


@pytest.fixture
def small_xla_blocks(monkeypatch):
  """Shrinks the XLA path's blocks so small tests walk many blocks."""
  from fa4_jax import xla_attention

  monkeypatch.setattr(xla_attention, "DEFAULT_BLOCK_Q", 16)
  monkeypatch.setattr(xla_attention, "DEFAULT_BLOCK_K", 16)
  monkeypatch.setattr(xla_attention, "MAX_ACCELERATOR_BLOCK", 16)
  jax.clear_caches()
  yield
  jax.clear_caches()
