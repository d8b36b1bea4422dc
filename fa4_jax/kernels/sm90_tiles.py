"""What the sm90 kernels share about their tiles: padded head dims and the
SMEM layout that both TMA and `wgmma` read."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.kernels import KernelUnsupported, check_common
from fa4_jax.scores import MaskSpec, cdiv

MAX_HEAD_DIM = 256

# The masks the heuristics tell apart (dense, causal, a causal window): every
# configuration they can pick shows up for one of these (`all_configs`).
HEURISTIC_MASKS = (MaskSpec(), MaskSpec(right=0), MaskSpec(left=256, right=0))


def check_supported(kernel: str, q_shape, k_shape, dtype, mask: MaskSpec) -> int:
  """The checks of every sm90 kernel; returns the head dim. Head dims other
  than 64, 128, 192 and 256 are padded (`padded_head_dim`)."""
  d = check_common(kernel, q_shape, k_shape, dtype, mask)[-1]
  if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
    raise KernelUnsupported(
        f"{kernel}: head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}]; got {d}")
  return d


def padded_head_dim(head_dim: int) -> int:
  """The kernels work on head dims that are multiples of 64 (128-byte
  swizzled rows); others are zero-padded up to that."""
  return cdiv(head_dim, 64) * 64


def swizzle_bytes(dtype, *block_rows: int) -> int:
  """The SMEM swizzle of every tile of a kernel whose GEMMs contract over
  these block sizes. wgmma wants its two SMEM operands equally swizzled and
  the swizzle span (in elements) to divide the contraction: 128 bytes for
  blocks of 64 rows or more, 64 bytes when a block has 32 rows."""
  return min(128, min(block_rows) * jnp.dtype(dtype).itemsize)


def smem_tile(shape, dtype, swizzle: int = 128):
  """SMEM layout wgmma and TMA use directly: (8, swizzle span) tiles, swizzled."""
  tile_cols = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(
      shape, dtype,
      transforms=(plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(swizzle)),
  )


def load_ids(ids_ref, batch_idx, start, n: int, *, along_rows: bool):
  """Segment ids [start, start + n) of one batch row as a vector along a
  wgmma tile's rows or columns. Element loads from GMEM (no optimized GMEM
  path exists for these layouts): only masked blocks need them."""
  layout = plgpu.Layout.WGMMA.reduce(1 if along_rows else 0)
  return plgpu.load(ids_ref.at[batch_idx, pl.ds(start, n)], layout=layout, optimized=False)
