"""The softmax's exp2 split between MUFU and a polynomial on the FMA pipe
(`fa4_jax.kernels.exp2_split`, `ForwardConfig.exp2_fma_eighths`, issue #55).

The polynomial against numpy's exp2 over the softmax's inputs (x = c s - m
<= RESCALE_THRESHOLD, masked scores at -inf), the float8 forward with a
share of the columns on it under the interpreter (against the f32 einsum
of tests/test_sm90_fp8.py, dense and causal), and the cross-lowered kernel:
fewer `ex2.approx`, the polynomial's shifts in their place.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax import gpu_target
from fa4_jax.kernels import exp2_split, sm90_forward
from fa4_jax.scores import RESCALE_THRESHOLD, MaskSpec, ScoreFunction
from test_sm90_fp8 import E4M3, assert_close_to_p_rounding, dequantized_reference, fp8_inputs

ROUNDING = {name: exp2_split.unit_roundoff(dtype) for name, dtype in (
    ("e4m3", E4M3), ("bf16", jnp.bfloat16), ("f16", jnp.float16))}


def softmax_inputs():
  """x = c s - m as the softmax forms it: every float32 in [-130, 9] on a
  fine grid (the max may be stale by up to RESCALE_THRESHOLD), the ends of
  the clamp, and what masked or hopeless scores give."""
  grid = np.linspace(-130.0, RESCALE_THRESHOLD + 1.0, 4_000_001)
  edges = [-127.0, -126.75, -126.5, -126.25, -126.0, -125.5, -125.0, -0.5, 0.0, 0.5, 8.0]
  far = [-np.inf, -1e30, -3e4, -200.0, np.nextafter(np.float32(-127), np.float32(-128))]
  return np.concatenate([grid, edges, far]).astype(np.float32)


@pytest.mark.parametrize("degree", [3, 2])
@pytest.mark.parametrize("jit", [False, True])
def test_the_polynomial_matches_numpy_exp2_over_the_softmax_range(jit, degree):
  x = softmax_inputs()
  fn = lambda x: exp2_split.polynomial_exp2_array(x, degree)
  got = np.asarray((jax.jit(fn) if jit else fn)(jnp.asarray(x)), np.float64)
  want = np.exp2(x.astype(np.float64))
  normal = x >= -125.0
  relative = np.abs(got[normal] / want[normal] - 1.0)
  assert relative.max() <= exp2_split.MAX_RELATIVE_ERROR[degree]
  assert relative.max() > 0.9 * exp2_split.MAX_RELATIVE_ERROR[degree]  # the bound is tight
  # Below the normal range: never negative, never above 2^-125, and exactly
  # zero from the clamp down (masked scores: a row that sees no key sums to 0).
  assert (got >= 0).all() and got[~normal].max() <= 2.0 ** -125
  assert (got[x <= -127.0] == 0.0).all()
  assert np.isfinite(got).all()


def test_up_to_the_top_of_the_exponent_range():
  x = np.linspace(9.0, 127.0, 100_001).astype(np.float32)
  got = np.asarray(exp2_split.polynomial_exp2_array(jnp.asarray(x)), np.float64)
  assert np.abs(got / np.exp2(x.astype(np.float64)) - 1.0).max() <= exp2_split.MAX_RELATIVE_ERROR[3]


def test_the_error_is_below_a_quarter_of_the_rounding_of_p():
  """Degree 3 for every P (float16's 2^-11 the finest), degree 2 for a
  float8 P only: `exp2_function` refuses it for a 16-bit one."""
  errors = exp2_split.MAX_RELATIVE_ERROR
  assert errors[3] < ROUNDING["f16"] / 4 and errors[2] < ROUNDING["e4m3"] / 16
  assert errors[2] > ROUNDING["bf16"] / 4
  exp2_split.exp2_function(4, 2, p_dtype=E4M3)
  exp2_split.exp2_function(4, 3, p_dtype=jnp.float16)
  with pytest.raises(ValueError, match="exp2_fma_degree=2"):
    exp2_split.exp2_function(4, 2, p_dtype=jnp.bfloat16)
  assert exp2_split.exp2_function(0, 2, p_dtype=jnp.bfloat16) is jnp.exp2


def test_the_fma_columns_are_eighths_of_the_tile_spread_evenly():
  assert exp2_split.fma_column_groups(128, 0) == ()
  assert exp2_split.fma_column_groups(128, 2) == (3, 7, 11, 15)
  assert len(exp2_split.fma_column_groups(128, 3)) == 6
  assert exp2_split.fma_column_groups(128, 4) == tuple(range(1, 16, 2))
  assert exp2_split.fma_column_groups(64, 3) == (2, 5, 7)
  assert exp2_split.fma_column_groups(128, 8) == tuple(range(16))


def test_config_takes_eighths_of_whole_column_groups():
  config = sm90_forward.ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2)
  assert config.exp2_fma_eighths == 0
  dataclasses.replace(config, exp2_fma_eighths=3)
  with pytest.raises(ValueError, match="exp2_fma_eighths"):
    dataclasses.replace(config, exp2_fma_eighths=9)
  with pytest.raises(ValueError, match="block_kv"):
    dataclasses.replace(config, block_kv=96, exp2_fma_eighths=2)
  with pytest.raises(ValueError, match="exp2_fma_degree"):
    dataclasses.replace(config, exp2_fma_degree=4)


def fp8_forward(mask, eighths, t, s, kv_lengths=None, degree=3):
  config = sm90_forward.fp8_config(sm90_forward.choose_config(128, mask, s, t), mask, 128, 128,
                                   False)
  config = dataclasses.replace(config, persistent=False, work_queue=False,
                               exp2_fma_eighths=eighths, exp2_fma_degree=degree)

  def call(q, k, v, descales):
    return sm90_forward.forward(
        q, k, v, None, kv_lengths, score=ScoreFunction(128 ** -0.5), mask=mask, config=config,
        descales=tuple(descales[x] for x in ("query_descale", "key_descale",
                                             "value_descale")))[0]
  return call


@pytest.mark.parametrize("causal, eighths, degree", [
    (False, 3, 3), (True, 3, 3), (True, 8, 3), (False, 4, 2)])
def test_fp8_forward_with_a_share_on_the_fma_pipe(run_interpreted, causal, eighths, degree):
  """GQA, an odd length, dense and causal: 3/8 of the columns, and all of
  them, through the polynomial; half of them through the degree-2 one."""
  (q8, k8, v8), descales = fp8_inputs(1, 150, 150, 4, 2, 128, seed=5)
  mask = MaskSpec(right=0) if causal else MaskSpec()
  got = run_interpreted(fp8_forward(mask, eighths, 150, 150, degree=degree), q8, k8, v8,
                        descales)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  assert rms(np.asarray(got, np.float32) - want) < 2.0 ** -4 / np.sqrt(3) * rms(want)


def test_fp8_forward_with_short_key_lengths_masks_through_the_polynomial(run_interpreted):
  """Keys past a row's length are -inf logits inside a block: the polynomial
  must give them P = 0 (the clamp), in its columns as MUFU does in its own."""
  (q8, k8, v8), descales = fp8_inputs(2, 150, 150, 4, 2, 128, seed=6)
  lengths = (150, 37)
  got = run_interpreted(fp8_forward(MaskSpec(), 8, 150, 150, jnp.asarray(lengths, jnp.int32)),
                        q8, k8, v8, descales)
  for b, n in enumerate(lengths):
    sl = slice(b, b + 1)
    want, v = dequantized_reference(q8[sl], k8[sl, :n], v8[sl, :n], descales, causal=False)
    assert_close_to_p_rounding(got[sl], want, v)


def test_bf16_forward_with_half_of_its_exp2_on_the_fma_pipe(run_interpreted):
  """The 16-bit kernel takes the same option (degree 3): against an f32
  softmax, as close as with every exp2 on MUFU."""
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 150, 2, 64)), jnp.bfloat16) for _ in range(3))
  mask = MaskSpec(right=0)

  def call(eighths):
    config = dataclasses.replace(sm90_forward.choose_config(64, mask, 150, 150),
                                 persistent=False, work_queue=False, exp2_fma_eighths=eighths)
    return lambda q, k, v: sm90_forward.forward(q, k, v, None, None,
                                                score=ScoreFunction(64 ** -0.5), mask=mask,
                                                config=config)[0]

  f32 = lambda x: np.asarray(x, np.float32)
  want = f32(jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          is_causal=True))
  errors = [np.abs(f32(run_interpreted(call(e), q, k, v)) - want).max() for e in (0, 4)]
  assert errors[1] <= max(1.5 * errors[0], 2.0 ** -7), errors


def lowered_counts(eighths, causal):
  mask = MaskSpec(right=0) if causal else MaskSpec()
  q = jax.ShapeDtypeStruct((2, 4096, 8, 128), E4M3)
  kv = jax.ShapeDtypeStruct((2, 4096, 2, 128), E4M3)
  call = fp8_forward(mask, eighths, 4096, 4096)
  ones = jnp.ones((8,), jnp.float32)
  descales = dict(query_descale=ones, key_descale=ones[:2], value_descale=ones[:2])

  def fn(q, k, v):
    with gpu_target("sm90"):
      return call(q, k, v, descales)

  from fa4_jax import testing
  lowered = testing.cross_lower(fn, q, kv, kv)
  text = "\n".join(lowered.modules)
  assert "e4m3.e4m3" in text
  return text.count("ex2.approx"), len(re.findall(r"arith\.shli", text)), lowered.smem_bytes


@pytest.mark.parametrize("causal", [False, True])
def test_the_share_cross_lowers_with_fewer_mufu_exponentials(causal):
  """Each softmax of the kernel (a thread's 64 scores of a 64 x 128 block)
  moves 3/8 of its `ex2.approx` (24) to the polynomial, whose 2 x 2 packed
  registers a column group take one shift each (12); SMEM is unchanged."""
  ex2_0, shl_0, smem_0 = lowered_counts(0, causal)
  ex2_3, shl_3, smem_3 = lowered_counts(3, causal)
  moved = ex2_0 - ex2_3
  assert moved >= 24 and moved % 24 == 0
  assert shl_3 - shl_0 == moved // 2
  assert smem_0 == smem_3
