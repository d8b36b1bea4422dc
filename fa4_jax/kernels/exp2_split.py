"""The softmax's exp2 split between the special-function unit and the FMA pipe.

On Hopper `ex2.approx` runs on the MUFU unit: 16 results a clock per SM,
against 128 FMAs a clock on the FMA pipe. In the float8 forward at head dim
128 the GEMMs take half their bfloat16 time per score and the exp2 alone
then takes as long as they do (docs/performance-notes.md, "The float8
forward on an H200"). `exp2_split(x, eighths)` computes `eighths` / 8 of a
score tile's key columns with a polynomial on the FMA pipe and the rest on
MUFU (`ForwardConfig.exp2_fma_eighths`; 0 is `jnp.exp2` itself, the
kernel as before).

The polynomial (`polynomial_exp2`, one formula for jax arrays and for
Mosaic GPU register fragments), for x <= 127:

1. x = max(x, -127): -inf (a masked score) and anything below becomes -127;
2. j = round(x), without a conversion instruction: t = x + 1.5 * 2^23 rounds
   x to an integer in t's low mantissa bits (|x| < 2^22), j = t - 1.5 * 2^23,
   and f = x - j (exact) lies in [-1/2, 1/2];
3. 2^f ~ p(f) = 1 + f (c1 + f (c2 + f c3)): three FMAs, a minimax fit of the
   relative error on [-1/2, 1/2] with p(0) = 1 exactly (`COEFFICIENTS`;
   `ForwardConfig.exp2_fma_degree` 2 drops c3 and one FMA, for float8 P only);
4. 2^j p(f): j added to p's exponent bits, as t's bits shifted left by 23
   (t's low 9 bits hold j modulo 2^9, and the shift drops the rest).

Eight instructions a score (max, two adds and a subtract, three FMAs, and a
shift-and-add, one LEA in SASS) where MUFU takes one. Maximum relative error
(`MAX_RELATIVE_ERROR`; checked against numpy in tests/test_exp2_split.py) for
x in [-125, 127]: degree 3 1.02e-4 (2^-13.3), below a quarter of P's
rounding to float16 (2^-11 relative), bfloat16 (2^-8) or e4m3 (2^-4);
degree 2 1.97e-3 (2^-9.0), half of bfloat16's rounding (refused for a
16-bit P: `exp2_function`) and about 1/32 of e4m3's. Below -125 the result
is not a normal f32: it is at most 2^-125 (where `ex2.approx.ftz` gives 0
below -126), never negative, and exactly 0 from -127 down, -inf included
(p(0) = 1 has the bits 127 << 23, and j = -127 takes them to 0): a row
that sees no key still sums to l = 0. The interpreter cannot run `inline_mgpu`; there the same formula
runs on the tile as jax ops, on the same columns.
"""

from __future__ import annotations

import numpy as np

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting

# Degree -> (c1, c2[, c3]) of p(f) = 1 + f (c1 + f (c2 + f c3)) ~ 2^f on
# [-1/2, 1/2]: a linear program minimizing the largest relative error with
# p(0) = 1, coefficients rounded to f32.
COEFFICIENTS = {
    2: (0.7029418349266052, 0.2398640364408493),
    3: (0.6932829022407532, 0.24221095442771912, 0.05500892922282219),
}
# Degree -> the largest relative error of `polynomial_exp2` for x in [-125, 127]
# in f32 arithmetic (the fits' own: 1.9634e-3 and 1.0129e-4).
MAX_RELATIVE_ERROR = {2: 1.97e-3, 3: 1.02e-4}
LOWEST = -127.0  # the clamp: 2^-127 p(0) encodes as +0.0
ROUNDER = 1.5 * 2.0 ** 23  # x + ROUNDER holds round(x) in its low mantissa bits
COLUMN_GROUP = 8  # keys a WGMMA accumulator register pair spans in a row


def polynomial_exp2(x, *, maximum, to_bits, from_bits, opaque=lambda t: t, degree: int = 3):
  """2^x by the polynomial (module docstring) for x of any array type whose
  `+`, `-`, `*` and `<<` are elementwise: `maximum(x, scalar)`, `to_bits`
  (f32 -> int32 bits) and `from_bits` (the inverse) are the type's own.
  `opaque(t)`: t as a value the compiler cannot see through (XLA's algebraic
  simplifier folds (x + c) - c to x; Mosaic GPU's MLIR and LLVM, under
  `contract` alone, do not)."""
  *lower, top = COEFFICIENTS[degree]
  x = maximum(x, LOWEST)
  t = opaque(x + ROUNDER)
  f = x - (t - ROUNDER)
  p = f * top
  for c in reversed(lower):
    p = (p + c) * f
  p = p + 1.0
  return from_bits(to_bits(p) + (to_bits(t) << 23))


def polynomial_exp2_array(x, degree: int = 3):
  """`polynomial_exp2` of a float32 jax array."""
  return polynomial_exp2(
      x.astype(jnp.float32), maximum=jnp.maximum,
      to_bits=lambda a: lax.bitcast_convert_type(a, jnp.int32),
      from_bits=lambda a: lax.bitcast_convert_type(a, jnp.float32),
      opaque=lax.optimization_barrier, degree=degree)


def fma_column_groups(num_keys: int, eighths: int) -> tuple[int, ...]:
  """Which 8-key column groups of a [rows, num_keys] tile take the
  polynomial: eighths / 8 of them, spread evenly (1/4 of 16 groups: 3, 7,
  11, 15)."""
  groups = num_keys // COLUMN_GROUP
  n = groups * eighths // 8
  return tuple(g for g in range(groups) if (g * n) // groups != ((g + 1) * n) // groups)


def check_config(eighths: int, degree: int, block_kv: int) -> None:
  """`ForwardConfig`'s exp2_fma_eighths and exp2_fma_degree."""
  if degree not in COEFFICIENTS:
    raise ValueError(f"ForwardConfig.exp2_fma_degree must be one of {sorted(COEFFICIENTS)}; "
                     f"got {degree}")
  if not 0 <= eighths <= 8:
    raise ValueError(f"ForwardConfig.exp2_fma_eighths must be in 0..8; got {eighths}")
  if eighths and block_kv % (8 * COLUMN_GROUP):
    raise ValueError("ForwardConfig.exp2_fma_eighths needs block_kv a multiple of 64; "
                     f"got {block_kv}")


def exp2_split(x, eighths: int, degree: int = 3):
  """2^x of a score tile `x` (f32 [64, keys], the wgmma accumulator's
  layout): the columns of `fma_column_groups` by the polynomial of `degree`,
  the others by `jnp.exp2` (MUFU's `ex2.approx` under the kernels'
  `approx_math`)."""
  if not eighths:
    return jnp.exp2(x)
  if is_interpreting():  # `fma_column_groups`' test on the column index (no array constants)
    g = lax.broadcasted_iota(jnp.int32, x.shape, 1) // COLUMN_GROUP
    n, groups = x.shape[1] // COLUMN_GROUP * eighths // 8, x.shape[1] // COLUMN_GROUP
    on_fma = (g * n) // groups != ((g + 1) * n) // groups
    return jnp.where(on_fma, polynomial_exp2_array(x, degree), jnp.exp2(x))
  return _exp2_split_registers(x, fma_column_groups(x.shape[1], eighths), degree)


def _exp2_split_registers(x, groups, degree):
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=layout))
  def split(_, x_fa: mgpu.FragmentedArray):
    regs = x_fa.registers  # [rows / 64, keys / 8, ...]: axis 1 is the column group
    assert regs.shape[1] == x.shape[1] // COLUMN_GROUP, regs.shape
    rest = [g for g in range(regs.shape[1]) if g not in groups]
    part = lambda idx: mgpu.FragmentedArray(_registers=regs[:, idx], _layout=x_fa.layout,
                                            _is_signed=None)
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    out = np.empty_like(regs)
    out[:, list(groups)] = polynomial_exp2(
        part(list(groups)), maximum=lambda a, b: a.max(b),
        to_bits=lambda a: a.bitcast(i32, output_is_signed=True),
        from_bits=lambda a: a.bitcast(f32), degree=degree).registers
    if rest:
      out[:, rest] = part(rest).exp2(approx=True).registers
    return mgpu.FragmentedArray(_registers=out, _layout=x_fa.layout, _is_signed=None)

  return split(x)


def unit_roundoff(dtype) -> float:
  """The largest relative rounding error of a value rounded to `dtype`
  (2^-4 for e4m3, 2^-8 for bfloat16, 2^-11 for float16)."""
  return 2.0 ** -(jnp.finfo(dtype).nmant + 1)


def exp2_function(eighths: int, degree: int = 3, *, p_dtype=jnp.bfloat16):
  """The exp2 a softmax calls: `jnp.exp2` where `eighths` is 0, else
  `exp2_split` with that share and degree. `p_dtype`: what P is rounded to
  for the P V GEMM; the polynomial's error must stay below a quarter of its
  rounding (degree 3 for every P, degree 2 for a float8 P only)."""
  if not eighths:
    return jnp.exp2
  if MAX_RELATIVE_ERROR[degree] >= unit_roundoff(p_dtype) / 4:
    raise ValueError(f"ForwardConfig.exp2_fma_degree={degree}: its relative error "
                     f"{MAX_RELATIVE_ERROR[degree]:.2g} is not below a quarter of the rounding "
                     f"of P in {jnp.dtype(p_dtype).name} (use degree 3)")
  return lambda x: exp2_split(x, eighths, degree)


__all__ = ["COEFFICIENTS", "MAX_RELATIVE_ERROR", "check_config", "exp2_function",
           "exp2_split", "fma_column_groups", "polynomial_exp2", "polynomial_exp2_array",
           "unit_roundoff"]
