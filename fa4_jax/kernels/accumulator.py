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

