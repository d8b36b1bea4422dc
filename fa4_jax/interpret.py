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
import threading

_state = threading.local()


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
  """
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
