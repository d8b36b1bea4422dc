"""Register-level pieces of the online softmax that Mosaic GPU's Pallas API
cannot express directly.

`rescale_rows(acc, alpha, skip_unchanged=True)` is FA4's conditional
rescaling on Hopper: the output accumulator O (a wgmma accumulator in
registers) is multiplied by the per-row factor alpha = exp2(m_old - m_new)
only in the warps where some row's running max actually moved. The kernels
keep a stale max until it grew past a threshold, so after the first KV block
alpha is exactly 1.0 almost everywhere, and the multiply (head_dim / 2 FMULs
per thread and block: 128 at head dim 256, against 32 exponentials for a
64-key block) is skipped by a warp-uniform branch. Exact: a skipped multiply
is a multiply by 1.0.

Pallas has no per-warp branch on array data, so the branch is written one
level down, with `plgpu.inline_mgpu`: each thread tests the alpha values of
its own rows, `vote.sync.any` makes the decision warp-uniform (a wgmma
accumulator row lives in one warp), and an `scf.if` yields either the
rescaled or the untouched registers. The GPU interpreter cannot run
`inline_mgpu`; there the plain multiply runs (same values).
"""

from __future__ import annotations

import numpy as np

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, nvvm, scf, vector
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting

_ALL_LANES = -1  # vote.sync member mask 0xffffffff as a signed i32


def rescale_rows(acc, alpha, *, skip_unchanged: bool):
  """acc * alpha[:, None] for a wgmma accumulator `acc` [rows, cols] (f32,
  WGMMA layout) and `alpha` [rows] (WGMMA row layout).

  With `skip_unchanged`, warps whose rows all have alpha == 1.0 keep their
  registers untouched (callers must produce exactly 1.0 for rows whose max
  did not move). Otherwise, and in the interpreter, every row is multiplied.
  """
  if not skip_unchanged or is_interpreting():
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  return _rescale_where_any_row_changed(acc, alpha)


def _rescale_where_any_row_changed(acc, alpha):
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(
      arg_types=(layout, layout.reduce(1)),
      return_type=plgpu.ShapeDtypeStruct(acc.shape, acc.dtype, layout=layout),
  )
  def rescale(_, acc_fa: mgpu.FragmentedArray, alpha_fa: mgpu.FragmentedArray):
    i32 = ir.IntegerType.get_signless(32)
    one = arith.constant(alpha_fa.mlir_dtype, 1.0)
    changed = None  # does any of this thread's rows have alpha != 1?
    for reg in alpha_fa.registers.flat:
      for i in range(ir.VectorType(reg.type).shape[0]):
        value = vector.extract(reg, dynamic_position=[], static_position=[i])
        differs = arith.cmpf(arith.CmpFPredicate.UNE, value, one)
        changed = differs if changed is None else arith.ori(changed, differs)
    changed = nvvm.vote_sync(arith.constant(i32, _ALL_LANES), changed, "any")
    branch = scf.IfOp(changed, [r.type for r in acc_fa.registers.flat], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scaled = acc_fa * alpha_fa.broadcast_in_dim(acc_fa.shape, (0,), acc_fa.layout)
      scf.yield_(list(scaled.registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(list(acc_fa.registers.flat))
    registers = np.asarray(list(branch.results), dtype=object).reshape(acc_fa.registers.shape)
    return mgpu.FragmentedArray(_registers=registers, _layout=acc_fa.layout, _is_signed=None)

  return rescale(acc, alpha)


# A float8 P as the register A operand of the P V wgmma. The accumulator
# layout gives a thread, in each 16-key chunk of a row, keys 2t, 2t + 1 (its
# 8-key tile) and 8 + 2t, 9 + 2t (the next one); the 8-bit A layout wants
# keys 4t .. 4t + 3 in one 32-bit register. Rather than exchanging bytes
# between threads, the thread's four keys are declared to be positions
# 4t .. 4t + 3, and V^T's keys are put in that order outside the kernel
# (`in_p_key_order`): the sum over keys is the same, with no shuffle.
# Key 8a + 2t + b of a chunk (a, b in {0, 1}, t < 4) sits at 4t + 2a + b.


def in_p_key_order(x, axis: int):
  """`x` with its `axis` (a multiple of 16 long) in the float8 P operand's
  key order within each 16-key chunk."""
  shape = x.shape
  x = x.reshape(shape[:axis] + (shape[axis] // 16, 2, 4, 2) + shape[axis + 1:])
  x = jnp.swapaxes(x, axis + 1, axis + 2)
  return x.reshape(shape)


def fp8_p_operand(p, dtype):
  """`p` (f32 [64, keys], WGMMA layout) as `dtype` (float8) in the 8-bit
  wgmma A layout, its keys in the order of `in_p_key_order`. The
  interpreter cannot run `inline_mgpu`: there the cast and the reordering
  are plain array operations (same values)."""
  if is_interpreting():
    return in_p_key_order(p, 1).astype(dtype)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(p.shape, dtype, layout=plgpu.Layout.WGMMA_8BIT),
  )
  def as_operand(_, p_fa: mgpu.FragmentedArray):
    p8 = p_fa.astype(mgpu.utils.dtype_to_ir_type(dtype))
    old = p8.registers  # [1, keys / 8, 1, 1, 2, 1, 1, 1, 1] of 2 keys
    new_shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape(p.shape)  # [1, keys / 16, ...] of 4
    new = np.empty(new_shape, dtype=object)
    for idx in np.ndindex(new_shape):
      lo = (idx[0], 2 * idx[1], *idx[2:])
      hi = (idx[0], 2 * idx[1] + 1, *idx[2:])
      new[idx] = mgpu.utils.vector_concat([old[lo], old[hi]])
    return mgpu.FragmentedArray(_registers=new, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)

  return as_operand(p)
