"""Running the Mosaic GPU kernels on the CPU, in Pallas' GPU interpret mode.

`interpret_mode()` is the one switch: inside it, every Mosaic GPU kernel that
fa4_jax traces runs in the interpreter (simulated SMEM, TMEM, barriers, TMA,
`wgmma`, `tcgen05_mma`), so kernel numerics and barrier protocols can be
tested on a machine without a GPU.

Kernels ask `is_interpreting()` where the interpreter lacks a construct the
fast path uses; the hardware path is never changed to suit the interpreter.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

_state = threading.local()

# The interpreter runs each warpgroup of a CTA as its own XLA CPU computation,
# all at once, each blocking in barrier waits, on XLA's CPU thread pool, beside
# the computation that launched them. The pool has NPROC threads (read when the
# CPU backend starts; by default the core count). With fewer threads than a
# CTA's warpgroups plus one, a kernel can deadlock at random: on a 2-core
# machine under load the D64 forward (four warpgroups) hung in 2 of 4 runs
# without NPROC, in none of 4 with NPROC=5 and none of 5 with NPROC=32.
# fa4_jax's kernels run at most four warpgroups; the tests set NPROC=32
# (`tests/conftest.py`).
MIN_INTERPRETER_THREADS = 8
RECOMMENDED_INTERPRETER_THREADS = 32


def interpreter_thread_pool_size() -> int:
  """The threads XLA's CPU pool gets: NPROC if set, else the core count."""
  nproc = os.environ.get("NPROC", "")
  return int(nproc) if nproc.isdigit() and int(nproc) > 0 else (os.cpu_count() or 1)


_warned_of_thread_pool = False


def _warn_if_thread_pool_is_small() -> None:
  """Once per process."""
  global _warned_of_thread_pool
  threads = interpreter_thread_pool_size()
  if threads < MIN_INTERPRETER_THREADS and not _warned_of_thread_pool:
    _warned_of_thread_pool = True
    warnings.warn(
        f"fa4_jax.interpret_mode: XLA's CPU thread pool has {threads} threads here, fewer than"
        f" the {MIN_INTERPRETER_THREADS} the GPU interpreter needs to run a kernel's"
        " warpgroups at once; a kernel may deadlock at random. Set the environment variable"
        f" NPROC={RECOMMENDED_INTERPRETER_THREADS} before JAX starts its CPU backend.",
        RuntimeWarning, stacklevel=3)


def is_interpreting() -> bool:
  """True while tracing under `interpret_mode()`."""
  return getattr(_state, "depth", 0) > 0


def _interpret_internals():
  # Private to jax 0.11.2: the interpreter's global state (races, buffers).
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  return interpret_pallas_call


def reset_interpreter_state() -> None:
  """Clears the interpreter's state; needed after a kernel raised inside it."""
  _interpret_internals().reset_gpu_interpret_mode_state()


def races_found() -> bool:
  """Whether the race detector saw a data race since the last reset."""
  races = _interpret_internals().get_races()
  return bool(races is not None and races.races_found)


@contextlib.contextmanager
def interpret_mode(detect_races: bool = False):
  """Runs fa4_jax's Mosaic GPU kernels in Pallas GPU interpret mode.

  Use with `implementation="sm90"` or `"sm100"` on a machine without a GPU:

      with fa4_jax.interpret_mode(detect_races=True):
        out = fa4_jax.attention(q, k, v, implementation="sm90")

  Interpretation is slow (seconds per call at small shapes): it is meant for
  tests. With `detect_races=True`, read `races_found()` afterwards. If a
  kernel raises inside the block, the interpreter's state is reset on exit.
  Traces made inside the block must not be reused outside it (call the
  function again, or `jax.clear_caches()`), since jit caches ignore the mode.
  On a machine with few cores set NPROC=32 in the environment before JAX
  starts (a `RuntimeWarning` says so): the interpreter needs a thread per
  warpgroup at once, and too few can deadlock a kernel.
  """
  _warn_if_thread_pool_is_small()
  from jax.experimental.pallas import mosaic_gpu as plgpu

  params = plgpu.InterpretGPUParams(detect_races=detect_races)
  _state.depth = getattr(_state, "depth", 0) + 1
  try:
    with plgpu.force_gpu_interpret_mode(params):
      yield
  except BaseException:
    reset_interpreter_state()
    raise
  finally:
    _state.depth -= 1
