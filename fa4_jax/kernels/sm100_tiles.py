"""What the sm_100 kernels (forward, dK/dV, dQ) share: the SM's budgets, the
TMEM register layouts, swizzled SMEM tiles, the waiting side of a barrier.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

# Hardware limits of one sm_100 SM.
TMEM_COLUMNS = 512  # 128 lanes x 512 columns of 32 bits
SMEM_BYTES = 232448  # dynamic shared memory per block (227 KiB)

# TMEM loads in the 32x32b shape: thread t of the warpgroup owns TMEM lane
# (row) t, so row reductions need no shuffles.
ROW_LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE
ROW_VECTOR_LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE.reduce(1)  # one value per row
# A vector along the columns, broadcast along the rows: every thread holds all
# of it (e.g. a block's key segment ids).
COL_VECTOR_LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE.reduce(0)
# Epilogues read accumulators in the 16x256b shape instead: Mosaic GPU can
# store that layout into swizzled SMEM for the TMA (not the 32x32b one).
EPILOGUE_LAYOUT = plgpu.Layout.TCGEN05


def smem_transforms(dtype, minor_dim: int):
  """Tiling and swizzle of an SMEM tile whose rows hold `minor_dim` elements."""
  swizzle = plgpu.find_swizzle(minor_dim * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def rem(x, n: int):
  """x mod n for a loop index (traced or a Python int)."""
  if isinstance(x, int):
    return x % n
  return lax.rem(x, jnp.asarray(n, x.dtype))


@dataclasses.dataclass(frozen=True)
class Waiter:
  """The waiting side of a barrier (one phase per call)."""

  ref: object

  def wait(self) -> None:
    plgpu.barrier_wait(self.ref)
