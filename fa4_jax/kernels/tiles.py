"""SMEM tile layouts that both kernel families (sm90 and sm100) use: the
swizzled tiles that TMA writes and the tensor cores (`wgmma`, `tcgen05`)
read directly."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def smem_tile(shape, dtype, swizzle: int = 128):
  """SMEM layout wgmma and TMA use directly: (8, swizzle span) tiles, swizzled."""
  tile_cols = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(
      shape, dtype,
      transforms=(plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(swizzle)),
  )


def smem_transforms(dtype, minor_dim: int):
  """Tiling and swizzle of an SMEM tile whose rows hold `minor_dim` elements:
  the widest swizzle those rows allow."""
  swizzle = plgpu.find_swizzle(minor_dim * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))
