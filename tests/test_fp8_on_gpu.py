"""The float8 sm90 forward on real hardware (skipped without a Hopper GPU):
training and prefill sizes, odd lengths, GQA, against an f32 einsum on the
dequantized operands, with the tolerance argued in tests/test_sm90_fp8.py
(P in e4m3: up to 2^-4 max|v|); then what ptxas makes of the float8
kernels (no wgmma serialized; spill bytes printed with `pytest -s`).
"""


import numpy as np
import pytest

import ptxas_dumps

import fa4_jax
from fa4_jax import backends
from fa4_jax.scores import ScoreFunction
from test_sm90_fp8 import E4M3, E5M2, assert_close_to_p_rounding, dequantized_reference, fp8_inputs

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")


@pytest.mark.parametrize("b, t, n, kv_heads, d, causal, dtype", [
    (2, 4096, 8, 2, 128, True, E4M3),
    (1, 3001, 4, 4, 64, False, E4M3),
    (1, 2053, 4, 1, 256, True, E4M3),
    (1, 2048, 4, 2, 128, False, E5M2),
])
def test_fp8_forward_at_scale(b, t, n, kv_heads, d, causal, dtype):
  (q8, k8, v8), descales = fp8_inputs(b, t, t, n, kv_heads, d, dtype, seed=d)
  assert fa4_jax.which_implementation(q8, k8, v8, is_causal=causal, **descales) == "sm90"
  got = fa4_jax.attention(q8, k8, v8, is_causal=causal, **descales)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)
  # The bound is a worst case; on the whole the error is at most that of one
  # e4m3 rounding (relative error uniform in +-2^-4: standard deviation
  # 2^-4 / sqrt(3), 3.6 %; P rounded in numpy on these inputs: 2 %).
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  assert rms(np.asarray(got, np.float32) - want) < 2.0 ** -4 / np.sqrt(3) * rms(want)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_p_in_registers_at_scale(causal):
  """`ForwardConfig.fp8_p_in_registers`: the register layout that lets P's
  bytes serve as the wgmma's A operand with V^T's keys reordered (the
  interpreter cannot check it)."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  (q8, k8, v8), descales = fp8_inputs(2, 2050, 2050, 8, 2, 128, E4M3, seed=3)
  mask = MaskSpec(right=0) if causal else MaskSpec()
  config = dataclasses.replace(sm90_forward.choose_config(128, mask, 2050, 2050),
                               fp8_p_in_registers=True)
  got, _ = sm90_forward.forward(
      q8, k8, v8, None, None, score=ScoreFunction(128 ** -0.5), mask=mask, config=config,
      descales=tuple(descales[x] for x in ("query_descale", "key_descale", "value_descale")))
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  assert rms(np.asarray(got, np.float32) - want) < 2.0 ** -4 / np.sqrt(3) * rms(want)



@pytest.mark.parametrize("b, t, n, kv_heads, d, causal", [
    (2, 2050, 8, 2, 128, False),
    (2, 2050, 8, 2, 128, True),
    (1, 3001, 4, 4, 64, False),
    (1, 2053, 4, 1, 256, True),
])
def test_fp8_row_sums_on_the_tensor_core_at_scale(b, t, n, kv_heads, d, causal):
  """`ForwardConfig.fp8_row_sums_on_tensor_core` (`FP8_ROW_SUMS_HEAD_DIMS`):
  l summed by an m64n8 wgmma of the P registers against e4m3 ones, in the
  hardware's float8 accumulation and register layout (the interpreter
  checks neither). Its error is the FADD sums' or smaller: the sum is of
  the rounded P, as O's numerator is (measured in the interpreter)."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  (q8, k8, v8), descales = fp8_inputs(b, t, t, n, kv_heads, d, E4M3, seed=7)
  mask = MaskSpec(right=0) if causal else MaskSpec()
  base = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, t, t), mask, d, d, False)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  errors = {}
  for on in (False, True):
    config = dataclasses.replace(base, fp8_row_sums_on_tensor_core=on)
    got, _ = sm90_forward.forward(
        q8, k8, v8, None, None, score=ScoreFunction(d ** -0.5), mask=mask, config=config,
        descales=tuple(descales[x] for x in ("query_descale", "key_descale", "value_descale")))
    assert_close_to_p_rounding(got, want, v)
    errors[on] = rms(np.asarray(got, np.float32) - want)
  print(f"RMS error, sums by FADDs {errors[False]:.4g}, on the tensor core {errors[True]:.4g}")
  assert errors[True] <= 1.05 * errors[False]


_COMPILE_FP8_KERNELS = r"""
import os
import jax, jax.numpy as jnp
import fa4_jax

items = {}
for d in (64, 128, 256):
  for causal in (False, True):
    def run(d=d, causal=causal):
      q = jnp.ones((1, 4096, 4, d), jnp.float8_e4m3fn)
      return fa4_jax.attention(q, q, q, is_causal=causal, implementation="sm90")
    items[f"fp8 d={d} causal={causal}"] = run
"""


def test_no_fp8_kernel_has_its_wgmmas_serialized_by_ptxas(tmp_path):
  calls = ptxas_dumps.compile_items(_COMPILE_FP8_KERNELS, tmp_path, timeout=400)
  ptxas_dumps.check_no_serialized_wgmmas(calls)
