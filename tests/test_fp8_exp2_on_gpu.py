"""The float8 forward with a share of its exp2 on the FMA pipe, on real
hardware (skipped without a Hopper GPU): the register-level split
(`fa4_jax.kernels.exp2_split`, `inline_mgpu`), which the interpreter cannot
run, against the XLA path on the dequantized operands, with the tolerance of
tests/test_sm90_fp8.py (P in e4m3: up to 2^-4 max|v|), and against the same
kernel with every exp2 on MUFU.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends
from fa4_jax.kernels import sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction
from test_sm90_fp8 import E4M3, assert_close_to_p_rounding, fp8_inputs

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")

rms = lambda x: float(np.sqrt(np.mean(np.square(np.asarray(x, np.float32)))))


def kernel(q8, k8, v8, descales, causal, eighths, kv_lengths=None, degree=3):
  t, s, d = q8.shape[1], k8.shape[1], q8.shape[3]
  mask = MaskSpec(right=0) if causal else MaskSpec()
  config = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, s, t), mask, d, d, False)
  config = dataclasses.replace(config, exp2_fma_eighths=eighths, exp2_fma_degree=degree)
  out, _ = sm90_forward.forward(
      q8, k8, v8, None, kv_lengths, score=ScoreFunction(d ** -0.5), mask=mask, config=config,
      descales=tuple(descales[x] for x in ("query_descale", "key_descale", "value_descale")))
  return np.asarray(out, np.float32)


def xla_reference(q8, k8, v8, descales, causal, kv_lengths=None):
  """The XLA path in float32 on the dequantized operands, and those values."""
  f32 = lambda x, name: x.astype(jnp.float32) * descales[name][None, None, :, None]
  q, k, v = f32(q8, "query_descale"), f32(k8, "key_descale"), f32(v8, "value_descale")
  want = fa4_jax.attention(q, k, v, is_causal=causal, implementation="xla",
                           key_value_seq_lengths=kv_lengths)
  return np.asarray(want, np.float32), np.asarray(v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("eighths, degree", [(3, 3), (2, 2)])
def test_fp8_exp2_share_at_scale(causal, eighths, degree):
  """B2 S4096 H16/4 D128, GQA: the bench's shape class at a size the test
  keeps short; 3/8 of the exp2 by the degree-3 polynomial, 1/4 by the
  degree-2 one."""
  (q8, k8, v8), descales = fp8_inputs(2, 4096, 4096, 16, 4, 128, E4M3, seed=11)
  got = kernel(q8, k8, v8, descales, causal, eighths, degree=degree)
  mufu = kernel(q8, k8, v8, descales, causal, 0)
  want, v = xla_reference(q8, k8, v8, descales, causal)
  assert_close_to_p_rounding(got, want, v)
  assert rms(got - want) < 2.0 ** -4 / np.sqrt(3) * rms(want)
  # The polynomial's error (1e-4 relative) moves a P's e4m3 rounding only
  # near a tie: the kernel stays within a hundredth of the MUFU kernel.
  assert rms(got - mufu) < 0.01 * rms(want), (rms(got - mufu), rms(want))


def test_fp8_exp2_share_masks_short_key_lengths():
  """Keys past each row's length (inside a block) are -inf logits: P = 0
  from the polynomial too, with every exp2 on it."""
  (q8, k8, v8), descales = fp8_inputs(3, 2048, 2048, 8, 2, 128, E4M3, seed=12)
  lengths = jnp.asarray([2048, 37, 1000], jnp.int32)
  got = kernel(q8, k8, v8, descales, False, 8, kv_lengths=lengths)
  want, v = xla_reference(q8, k8, v8, descales, False, kv_lengths=lengths)
  assert_close_to_p_rounding(got, want, v)
  assert rms(got - want) < 2.0 ** -4 / np.sqrt(3) * rms(want)
