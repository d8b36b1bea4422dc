"""The float8 forward with the row sums on the tensor core
(`ForwardConfig.fp8_row_sums_on_tensor_core`; the default at the head dims of
`sm90_forward.FP8_ROW_SUMS_HEAD_DIMS`, here forced at every head dim):
the P V wgmma's accumulator gets a few more columns, which a narrow wgmma of
the same P against a tile of ones fills with the rows' sums.

In the interpreter, against the f32 einsum on the dequantized operands, under
`tests/test_sm90_fp8.py`'s bound (the e4m3 rounding of P). The sum is then
of the rounded P, as the numerator's is, which measured no worse than the
FADD sum of the unrounded P (docs/performance-notes.md). On hardware the
wgmma's own accumulation (and its register layout) are the GPU's to check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import gpu_target
from fa4_jax.kernels import sm90_forward
from fa4_jax.scores import MaskSpec

from test_sm90_fp8 import (E4M3, E5M2, assert_close_to_p_rounding, dequantized_logits,
                           dequantized_reference, fp8_inputs, sink_share)


@pytest.fixture
def row_sums_on(monkeypatch):
  monkeypatch.setattr(sm90_forward, "FP8_ROW_SUMS_HEAD_DIMS", (64, 128, 192, 256))


@pytest.mark.parametrize("b, t, s, n, kv_heads, d, causal, dtype", [
    (1, 150, 150, 2, 1, 128, False, E4M3),  # dense, GQA, two key blocks, the last one short
    (1, 100, 100, 2, 1, 64, True, E5M2),     # causal, GQA, odd length, e5m2 (P stays e4m3)
])
def test_row_sums_on_the_tensor_core_match_the_dequantized_reference(
    run_interpreted, row_sums_on, b, t, s, n, kv_heads, d, causal, dtype):
  (q8, k8, v8), descales = fp8_inputs(b, t, s, n, kv_heads, d, dtype, seed=4)
  call = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal, implementation="sm90",
                                           **descales)
  got = run_interpreted(call, q8, k8, v8)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)


def test_row_sums_on_the_tensor_core_start_from_a_sink(run_interpreted, row_sums_on):
  """A sink starts the row-sum columns at 1 (`initial_row_stats`): the
  output is the reference's with the sink's virtual key in the softmax."""
  (q8, k8, v8), descales = fp8_inputs(1, 70, 70, 2, 1, 64, seed=6)
  sinks = jnp.asarray([0.5, 2.0], jnp.float32)
  call = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90",
                                           sinks=sinks, **descales)
  got = run_interpreted(call, q8, k8, v8)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=True)
  # softmax over (sink, keys): the keys' weights shrink by sum / (sum + e^sink).
  logits, _ = dequantized_logits(q8, k8, v8, descales)
  logits = np.where(np.tril(np.ones((70, 70), bool)), logits, -np.inf)
  want = want * sink_share(logits, sinks)
  assert_close_to_p_rounding(got, want, v)


def test_the_switch_makes_the_heuristic_add_a_narrow_row_sum_wgmma(cross_lower, row_sums_on):
  """Switched on, the heuristic's float8 D128 config takes the row sums to
  the tensor core: besides the m64n128 P V wgmma (P from registers) an
  m64n8 one with the same register A operand."""
  import re

  mask = MaskSpec()
  config = sm90_forward.fp8_config(sm90_forward.choose_config(128, mask, 1024, 1024), mask,
                                   128, 128, False)
  assert config.row_sums_on_tensor_core
  spec = jax.ShapeDtypeStruct((1, 1024, 2, 128), E4M3)

  def call(q, k, v):
    with gpu_target("sm90"):
      return fa4_jax.attention(q, k, v, implementation="sm90")

  text = "\n".join(cross_lower(call, spec, spec, spec).modules)
  shapes = {(m.group(1), m.group(2)) for m in re.finditer(
      r"m64n(\d+)k32\.f32\.e4m3\.e4m3 \{[$\d,]+\}, (\S)", text)}
  assert shapes == {("128", "$"), ("128", "{"), ("8", "{")}  # Q K^T, P V, P ones


def test_row_sums_on_the_tensor_core_with_wide_key_blocks(run_interpreted):
  """192 and 256 keys per block (`bench_fp8.ROW_SUM_BLOCKS`: without the FADD
  sums they fit the registers): the ones tile and P's key order span the
  wider block (two blocks, the last one short; 192-byte rows swizzle by 64)."""
  import dataclasses

  from fa4_jax.scores import ScoreFunction

  (q8, k8, v8), descales = fp8_inputs(1, 60, 300, 1, 1, 128, seed=8)
  mask = MaskSpec()
  base = sm90_forward.fp8_config(sm90_forward.choose_config(128, mask, 300, 60), mask, 128,
                                 128, False)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=False)
  for block_kv in (192, 256):
    config = dataclasses.replace(base, block_kv=block_kv, num_kv_stages=2, persistent=False,
                                 work_queue=False, q_buffers=1, fp8_row_sums_on_tensor_core=True)
    call = lambda q, k, v, config=config: sm90_forward.forward(
        q, k, v, None, None, score=ScoreFunction(128 ** -0.5), mask=mask, config=config,
        descales=tuple(descales[x] for x in ("query_descale", "key_descale",
                                             "value_descale")))[0]
    assert_close_to_p_rounding(run_interpreted(call, q8, k8, v8), want, v)
