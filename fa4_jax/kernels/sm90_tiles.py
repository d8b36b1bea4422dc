"""What the sm90 kernels share about their tiles: padded head dims, the
swizzle their `wgmma`s need, segment ids and the element mask in the WGMMA
layout. The SMEM tiles themselves are `tiles.smem_tile` (both families)."""

from __future__ import annotations

import functools

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported, check_common
from fa4_jax.kernels.mod_tiles import bound_mask_hook  # noqa: F401 (sm90_forward's)
from fa4_jax.mod_functions import Positions
from fa4_jax.scores import MaskSpec, cdiv, visible

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


def _ids_layout(along_rows: bool):
  return plgpu.Layout.WGMMA.reduce(1 if along_rows else 0)


def load_ids(ids_ref, batch_idx, start, n: int, *, along_rows: bool):
  """Segment ids [start, start + n) of one batch row as a vector along a
  wgmma tile's rows or columns. Element loads from GMEM (no optimized GMEM
  path exists for these layouts): for the few ids a tile keeps (its rows'
  2 per thread); a block's ids along the columns come through an `id_ring`."""
  return plgpu.load(ids_ref.at[batch_idx, pl.ds(start, n)], layout=_ids_layout(along_rows),
                    optimized=False)


def id_ring(num_slots: int, n: int):
  """SMEM for the segment ids of the blocks a ring streams: `n` int32 ids
  per slot, TMA-loaded by the producer with the block's tiles (its slot's
  full barrier expects one more copy).

  Along a wgmma tile's columns a thread holds n / 4 ids (32 registers at
  128 keys); loaded from GMEM before a block's first wgmma, to hide the
  latency, they stayed live across it beside S and O and spilled (ptxas,
  H200: D64 window forward 640 bytes, D128 dense dK/dV 1336, against 0 and
  48 without segment ids). From SMEM they are read after the wgmma wait,
  a few columns at a time where the element mask uses them
  (`where_visible_by_column_chunks`)."""
  return plgpu.SMEM((num_slots, n), jnp.int32)


def read_ids(slot_ref, *, along_rows: bool = False):
  """The ids of one `id_ring` slot as a vector along a wgmma tile's rows or
  columns (vectorized SMEM loads)."""
  return plgpu.load(slot_ref, layout=_ids_layout(along_rows))


# Columns whose segment ids `where_visible_by_column_chunks` reads at once:
# 8 (2 ids per thread, one 8-byte SMEM load) spilled least (ptxas, H200,
# every segment-id kernel the heuristics pick: 13512 bytes in all, 15824
# with 16 columns, 21496 with 32; the forward spills nothing with 8 or 16).
ID_CHUNK = 8


def where_visible_by_column_chunks(x, column_ids, visible_of, fill):
  """`jnp.where(visible, x, fill)` of a wgmma tile whose element mask needs
  its columns' segment ids, held by `column_ids` (an `id_ring` slot): one
  chunk of `ID_CHUNK` columns after another, each chunk's ids read from SMEM
  right before its selects, so that a thread holds 2 ids at a time where
  all of a 128-column tile's took 32 registers. `visible_of(first_column,
  ids)`: the element mask of the chunk whose first column is
  `first_column`, `ids` its columns' ids (a vector along them).

  Its caller, `where_visible`, builds what every chunk shares (the chunk's
  row and column iotas, the rows' ids broadcast) once per tile and shifts
  the column iota per chunk (`chunk_shape`). Mosaic GPU's layout inference
  searches the layout of most traced ops, reducing the whole kernel's
  constraint system at each step: with all of it traced per chunk, a
  segment-id forward left 308 of 868 variables to that search and lowered
  7x slower than the plain one; now 188 of 643. Tracing only the id
  compare per chunk (the positions masked once on the whole tile) lowered
  faster still but made ptxas spill twice as much and the packed GQA
  forward 15-21 % slower (performance notes)."""
  n = x.shape[1]
  assert n % ID_CHUNK == 0, (n, ID_CHUNK)
  parts = []
  for first in range(0, n, ID_CHUNK):
    ids = read_ids(column_ids.at[pl.ds(first, ID_CHUNK)])
    parts.append(jnp.where(visible_of(first, ids), x[:, first:first + ID_CHUNK], fill))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def chunk_shape(tile_shape) -> tuple[int, int]:
  """The shape of one chunk of `where_visible_by_column_chunks`."""
  return tile_shape[0], ID_CHUNK


def mod_positions(shape, *, row_lo, col_lo, keys_along_rows: bool, bound=None,
                  aligned: bool = False):
  """(q_idx, kv_idx) of a wgmma tile of `shape` as a `score_mod` or
  `mask_mod` sees them: vectors along the tile's rows and columns
  (`mod_functions.Along`, in the row and column layouts of the WGMMA one),
  which the mods' interpreter broadcasts only where an op needs the whole
  tile. Rows start at `row_lo` (keys when `keys_along_rows`), columns at
  `col_lo`. `bound`: every position is below it (None: unknown). Both are
  `Positions`: a first position and the offsets from it (the affine form
  of a score_mod measures from it, `mod_functions.affine_form`).
  `aligned`: `row_lo` and `col_lo` are multiples of the tile's extents
  along their axes (`Positions.align`)."""
  def along(axis, lo):
    layout = plgpu.Layout.WGMMA.reduce(1 - axis)
    offsets = lambda: plgpu.broadcasted_iota(jnp.int32, (shape[axis],), 0, layout=layout)
    return Positions(lo, offsets, axis, tuple(shape), bound,  # traced where the mod reads it
                     align=shape[axis] if aligned else None)

  rows, cols = along(0, row_lo), along(1, col_lo)
  return (cols, rows) if keys_along_rows else (rows, cols)


def where_visible(x, fill, *, mask: MaskSpec, row_lo, col_lo, keys_along_rows: bool, kv_len,
                  q_len, segments=None, mask_mod=None):
  """`x` (a wgmma tile) where `scores.visible` lets its query see its key,
  `fill` elsewhere: the element mask of every sm90 kernel. The tile's rows
  start at `row_lo` and hold queries (keys when `keys_along_rows`, as in
  the kernels that own keys), its columns start at `col_lo`. `segments`:
  None, or the ids of the rows (a vector along them, `load_ids`) and of the
  columns (their `id_ring` slot, read a chunk at a time:
  `where_visible_by_column_chunks`).

  `mask_mod`: None, or a hook `mask_mod(q_idx, kv_idx) -> bool` (True:
  visible) and-ed with the built-in mask; `q_idx` and `kv_idx` are int32
  tiles of positions (WGMMA layout, the tile's shape or, with `segments`, a
  chunk's), already oriented by `keys_along_rows`, so the hook never cares
  which side holds the keys. `mask_mod_hook` makes one from a user's traced
  `mask_mod`. Without it the traced program is the one built before it
  existed."""
  shape = x.shape if segments is None else chunk_shape(x.shape)
  iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, shape, layout=plgpu.Layout.WGMMA)
  rows, cols = row_lo + iota(0), col_lo + iota(1)
  if segments is None:
    k_idx, q_idx = (rows, cols) if keys_along_rows else (cols, rows)
    ok = visible(mask, q_idx, k_idx, kv_len, q_len=q_len)
    if mask_mod is not None:
      ok = ok & mask_mod(*mod_positions(shape, row_lo=row_lo, col_lo=col_lo,
                                        keys_along_rows=keys_along_rows))
    return jnp.where(ok, x, fill)
  row_ids, column_ids = segments
  row_seg = lax.broadcast_in_dim(row_ids, shape, [0])

  def visible_of(first_col, col_ids):
    """The element mask of the chunk of columns from `first_col`."""
    chunk_cols = cols + first_col if first_col else cols
    col_seg = lax.broadcast_in_dim(col_ids, shape, [1])
    k_idx, q_idx = (rows, chunk_cols) if keys_along_rows else (chunk_cols, rows)
    kv_seg, q_seg = (row_seg, col_seg) if keys_along_rows else (col_seg, row_seg)
    ok = visible(mask, q_idx, k_idx, kv_len, q_seg, kv_seg, q_len=q_len)
    if mask_mod is not None:
      ok = ok & mask_mod(q_idx, k_idx)
    return ok

  return where_visible_by_column_chunks(x, column_ids, visible_of, fill)


def mask_mod_hook(mask_mod, captured_refs, batch_idx, head_idx):
  """`where_visible`'s `mask_mod` hook for a user's traced `mask_mod`
  (`fa4_jax.mod_functions.ModFunction`): it evaluates it on the tile
  (`mod_functions.evaluate_in_kernel`). `captured_refs`: its captured arrays
  as GMEM refs, in `mask_mod.captured_avals`' order (0-d ones as shape (1,));
  `batch_idx`, `head_idx`: the scalars it sees (global: a sharded call's
  offsets added, `scores.Scores.global_indices`). None for no `mask_mod`."""
  if mask_mod is None:
    return None
  from fa4_jax import mod_functions
  return bound_mask_hook(mod_functions.bind(mask_mod, captured_refs, batch_idx, head_idx))


# --- Per-element reads of a score_mod's captured table ----------------------
# A lookup `table[head, index(q_idx, kv_idx)]` whose index varies over the
# tile is one load per element: the entries of the looked-up row are a few
# hundred bytes that stay in L1 after the first block, and the threads of a
# warp read within one such row, so each load is one L1 wavefront. A chain
# of selects over the entries instead costs two ops per entry and element
# (and the entries' registers: a 32-entry table spilled on an H100).


# Off, tables are read by the chain of selects (what the interpreter and
# sm100 do); `benchmarks/bench_mod_costs.py` (MOD_COSTS_TABLE_LOADS=0) turns
# it off to time that chain. Measured: the performance notes, "Table lookups
# as one load per element".
PER_ELEMENT_TABLE_LOADS = True


def element_loader():
  """The `loader` of `mod_functions.bind` for sm90 tiles (WGMMA layout and
  its row and column vectors): `load_elements` where
  `PER_ELEMENT_TABLE_LOADS`; None in the GPU interpreter, which cannot run
  `inline_mgpu`, and otherwise (the mods' interpreter then reads tables by
  its chain of selects: same values)."""
  if is_interpreting() or not PER_ELEMENT_TABLE_LOADS:
    return None
  return load_elements


def load_elements(row, index, axis=None):
  """row[index] per element: `row` a 1-D GMEM ref (a view of a captured
  array along the looked-up axis, its other indices fixed), `index` an
  int32 tile in the WGMMA layout (or, with `axis`, a vector along that axis
  of such a tile), every element within [0, len(row)). One invariant
  global load (`ld.global.nc`) per element, at row + index * stride."""
  layout = plgpu.Layout.WGMMA if axis is None else plgpu.Layout.WGMMA.reduce(1 - axis)
  index = plgpu.layout_cast(index, layout)
  dtype = row.dtype

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), layout),
                     return_type=plgpu.ShapeDtypeStruct(index.shape, dtype, layout=layout))
  def load(_, ref, idx):
    return _element_loads(ref, idx, dtype)

  return load(row, index)


def _element_loads(ref, idx, dtype):
  """The body of `load_elements` on Mosaic GPU values: `ref` a 1-D GMEM
  memref, `idx` an int32 FragmentedArray."""
  utils = mgpu.utils
  i32 = ir.IntegerType.get_signless(32)
  ref_type = ir.MemRefType(ref.type)
  (stride,), _ = ref_type.get_strides_and_offset()
  element = utils.dtype_to_ir_type(dtype)
  # Kernel arguments in GMEM are generic pointers to global memory; as
  # global (address space 1) pointers the invariant loads become ld.global.nc.
  row = llvm.addrspacecast(llvm.PointerType.get(1), utils.memref_ptr(ref))

  def one(i):
    if stride != 1:
      i = arith.muli(i, utils.c(stride, i32))
    return llvm.load(element, utils.getelementptr(row, [i], element), invariant=True)

  registers = np.empty(idx.registers.shape, dtype=object)
  for position, reg in np.ndenumerate(idx.registers):
    if not isinstance(reg.type, ir.VectorType):
      registers[position] = one(reg)
      continue
    [width] = ir.VectorType(reg.type).shape
    out = llvm.mlir_undef(ir.VectorType.get([width], element))
    for i in range(width):
      value = one(vector.extract(reg, dynamic_position=[], static_position=[i]))
      out = vector.insert(value, out, dynamic_position=[], static_position=[i])
    registers[position] = out
  return mgpu.FragmentedArray(_registers=registers, _layout=idx.layout,
                              _is_signed=utils.is_signed(dtype))
