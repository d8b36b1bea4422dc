"""What the sm_100 kernels (forward, dK/dV, dQ) share: the SM's budgets, the
TMEM register layouts, the element mask, and the K/V rings' barrier
declarations (`KV_RINGS`, in the form of `pipeline.BarrierTable`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.kernels.pipeline import COMMIT, TMA, WAIT, WAITER, Barrier, BarrierTable

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


def element_mask(mask: scores.MaskSpec, shape, *, row_lo, col_lo, keys_along_rows: bool, kv_len,
                 q_len, segments=None, hide_rows_past_q_len: bool = False, mask_mod=None):
  """`scores.visible` over a `ROW_LAYOUT` tile of `shape` whose rows start
  at `row_lo` and hold queries (keys when `keys_along_rows`, as in the
  dK/dV kernel), its columns at `col_lo`: the element mask of every sm100
  kernel. `segments`: None, or (the rows' ids as a vector along them, the
  GMEM ids [B, length] of what the columns hold, the batch index). The
  columns' ids are read here, so only blocks that need the element mask
  pay, one 4-byte id per column and thread (Mosaic GPU lowers GMEM loads
  into these layouts only unoptimized: per-thread loads, no SMEM plan).
  `hide_rows_past_q_len`: also hide rows at or past `q_len` (the forward,
  whose rows are queries). `mask_mod`: None, or a hook (q_idx, kv_idx) ->
  bool tile and-ed with the built-ins (`mod_tiles.TileMods.mask_hook`);
  without it the traced program is the one built before it existed."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=ROW_LAYOUT) + row_lo
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=ROW_LAYOUT) + col_lo
  row_seg = col_seg = None
  if segments is not None:
    row_ids, column_ids_ref, batch_idx = segments
    column_ids = plgpu.load(column_ids_ref.at[batch_idx, pl.ds(col_lo, shape[1])],
                            layout=COL_VECTOR_LAYOUT, optimized=False)
    row_seg = lax.broadcast_in_dim(row_ids, shape, [0])
    col_seg = lax.broadcast_in_dim(column_ids, shape, [1])
  k_idx, q_idx = (rows, cols) if keys_along_rows else (cols, rows)
  kv_seg, q_seg = (row_seg, col_seg) if keys_along_rows else (col_seg, row_seg)
  ok = scores.visible(mask, q_idx, k_idx, kv_len, q_seg, kv_seg, q_len=q_len)
  if mask_mod is not None:
    ok = ok & mask_mod(q_idx, k_idx)
  return ok & (rows < q_len) if hide_rows_past_q_len else ok


def tile_positions(shape, *, row_lo, col_lo, keys_along_rows: bool):
  """(q_idx, kv_idx): int32 `ROW_LAYOUT` tiles of `shape` of the query and
  key positions of a tile whose rows start at `row_lo` (keys when
  `keys_along_rows`) and columns at `col_lo`: what a `score_mod` sees."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=ROW_LAYOUT) + row_lo
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=ROW_LAYOUT) + col_lo
  return (cols, rows) if keys_along_rows else (rows, cols)


# The K and V rings of a kernel whose load warp streams K and V blocks
# through ring slots that its MMA warp frees (the forward and the dQ kernel),
# one barrier of each per "stage"; the table splices them into its BARRIERS
# and derives from `KvRingBarrierTable`.
KV_RINGS = {
    "k_full": Barrier("stage", 1, False, arrive={"producer_k": TMA}, wait={"consumer_k": WAITER}),
    "k_free": Barrier("stage", 1, True, arrive={"consumer_k_release": COMMIT},
                      wait={"producer_k_acquire": WAIT}),
    "v_full": Barrier("stage", 1, False, arrive={"producer_v": TMA}, wait={"consumer_v": WAITER}),
    "v_free": Barrier("stage", 1, True, arrive={"consumer_v_release": COMMIT},
                      wait={"producer_v_acquire": WAIT}),
}


class KvRingBarrierTable(BarrierTable):
  """A `BarrierTable` with the `KV_RINGS`, and their drain."""

  def drain_kv_rings(self, num_steps) -> None:
    """Load warp, interpreter only: observe the k_free / v_free phases of the
    last lap."""
    self._drain_last_lap(num_steps, "k_free", "v_free")
