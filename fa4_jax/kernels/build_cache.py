"""One trace and one lowering per kernel configuration.

A model that calls attention with the same shapes in several places (layers
that are not scanned, the forward replayed by `jax.checkpoint`, an eval and
a train step in one program) would otherwise trace the Python kernel body and
lower it to Mosaic GPU once per call site: seconds each on the CPU, and the
same kernel every time. `cached_build` turns a kernel builder (keyword
arguments that fix the kernel -> a `plgpu.kernel` callable) into one that
returns the same `jax.jit`-wrapped callable for the same arguments. Inside a
trace, jit reuses that callable's trace for arrays of the same shapes, and
the lowering of one program emits its Mosaic GPU module once, called from
every site. The kernel itself is the one the builder makes.

The interpreter (`fa4_jax.interpret_mode`) bypasses the cache: its traces
carry the interpreter's settings, which are no part of the key.
"""

from __future__ import annotations

import functools

import jax

from fa4_jax.interpret import is_interpreting

# Kernel configurations kept (shapes x masks x options); each holds a jitted
# callable and its traces, a few hundred KB.
MAX_CACHED_KERNELS = 256


def cached_build(build):
  """`build` (hashable arguments -> kernel callable), memoized and jitted."""

  @functools.lru_cache(maxsize=MAX_CACHED_KERNELS)
  def jitted(*args, **kwargs):
    return jax.jit(build(*args, **kwargs))

  @functools.wraps(build)
  def cached(*args, **kwargs):
    if is_interpreting():
      return build(*args, **kwargs)
    return jitted(*args, **kwargs)

  cached.cache_clear = jitted.cache_clear
  cached.cache_info = jitted.cache_info
  return cached
