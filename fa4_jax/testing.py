"""Test support for Mosaic GPU kernels on a machine without a GPU.

Two ways to check a kernel with no GPU at hand:

* `run_interpreted(fn, *args)`: runs `fn` under Pallas' GPU interpret mode
  (numerics, barrier protocol, race detection).
* `cross_lower(fn, *specs, arch="sm_90")`: lowers `fn` for CUDA on the CPU and
  returns the Mosaic GPU modules it contains, with their shared-memory size and
  a way to ask which PTX-level instructions they use. This catches what the
  interpreter cannot: the shared-memory budget, layouts, and whether the kernel
  really issues `wgmma` / `tcgen05.mma`.

`tests/conftest.py` turns these into pytest fixtures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable
from unittest import mock

import jax

from fa4_jax import interpret
from fa4_jax.target import gpu_target

# Dynamic shared memory a thread block may use on sm_90 and sm_100 (227 KiB).
SMEM_LIMIT_BYTES = 232448
# Tensor memory columns per SM on sm_100.
TMEM_COLUMNS = 512

_ARCHES = {"sm_90": "sm90", "sm_100": "sm100"}  # -> fa4_jax.gpu_target names
_SMEM_SIZE = re.compile(r"dynamic_shared_memory_size %c(\d+)_i32")


@dataclasses.dataclass
class LoweredKernels:
  """The Mosaic GPU kernels found in one cross-lowered function."""

  arch: str
  modules: list[str]  # MLIR text of each kernel module, before serialization
  smem_bytes: list[int]  # dynamic shared memory of each kernel launch

  def has(self, instruction: str) -> bool:
    """Whether any kernel uses `instruction` (e.g. "wgmma.mma_async").

    Matches both NVVM dialect ops (`nvvm.wgmma.mma_async`) and inline PTX
    (`mbarrier.init.shared::cta.b64`).
    """
    return any(instruction in m for m in self.modules)

  @property
  def max_smem_bytes(self) -> int:
    return max(self.smem_bytes, default=0)


def _target_arch(arch: str):
  """Makes Mosaic GPU lower for `arch` although no GPU is present."""
  if arch not in _ARCHES:
    raise ValueError(f"arch must be one of {sorted(_ARCHES)}, got {arch!r}")
  return gpu_target(_ARCHES[arch])


@contextlib.contextmanager
def _capture_modules(into: list[str]):
  from jax.experimental.mosaic.gpu import core as mgpu_core

  from fa4_jax.kernels import compile_ahead

  compile_ahead.install()  # before the patch, which would otherwise undo it
  original = mgpu_core._mosaic_gpu_lowering_rule

  def capturing_rule(ctx, *args, module, **kwargs):
    into.append(module.operation.get_asm(enable_debug_info=False))
    return original(ctx, *args, module=module, **kwargs)

  with mock.patch.object(mgpu_core, "_mosaic_gpu_lowering_rule", capturing_rule):
    yield


def cross_lower(fn: Callable, *arg_specs: Any, arch: str = "sm_90") -> LoweredKernels:
  """Lowers `fn(*arg_specs)` for CUDA on this (GPU-less) machine.

  `arg_specs` are arrays or `jax.ShapeDtypeStruct`s. Caches are cleared first
  so that every kernel is really lowered again under the requested arch.
  """
  jax.clear_caches()
  modules: list[str] = []
  with _target_arch(arch), _capture_modules(modules):
    jax.jit(fn).trace(*arg_specs).lower(lowering_platforms=("cuda",))
  jax.clear_caches()
  smem = [int(m) for text in modules for m in _SMEM_SIZE.findall(text)]
  return LoweredKernels(arch=arch, modules=modules, smem_bytes=smem)


def run_interpreted(fn: Callable, *args: Any, detect_races: bool = True, **kwargs: Any):
  """Runs `fn` in Pallas GPU interpret mode and checks for data races.

  Raises AssertionError when the race detector found one. The interpreter's
  state is reset before and after, also when `fn` raises.
  """
  jax.clear_caches()  # a trace made outside interpret mode must not be reused
  interpret.reset_interpreter_state()
  try:
    with interpret.interpret_mode(detect_races=detect_races):
      out = jax.block_until_ready(fn(*args, **kwargs))
      raced = detect_races and interpret.races_found()
  finally:
    interpret.reset_interpreter_state()
    jax.clear_caches()
  if raced:
    raise AssertionError("the GPU interpreter detected a data race")
  return out


def force_host_devices(count: int) -> None:
  """Asks XLA for `count` CPU devices; call before JAX initialises a backend."""
  jax.config.update("jax_num_cpu_devices", count)
