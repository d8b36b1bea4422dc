"""The float8 forward with FA3's intra-warpgroup overlap
(`ForwardConfig.overlap_pv_with_softmax`; the heuristic's at D128, dense
and causal, without segment ids or mods): block j's turn issues
S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, runs the softmax of S_j while
the P V wgmma runs, then rescales O by alpha_j; the first block of a
consumer's range only computes P, the last P V runs after the range.

In the interpreter, against the f32 einsum on the dequantized operands,
under `tests/test_sm90_fp8.py`'s bound (the e4m3 rounding of P). The cases
cover a consumer with several blocks (masked and full ones), with one block
(the first step, then the last P V), with none (its rows past the query
length), a short key length, the FADD row sums, no turns between the consumers, a sliding
window (skip steps before a consumer's first block) and a sink (whose initial
row-sum columns the first block rescales). The wgmmas' order and ptxas's
verdict (no serialized wgmma) are the cross-lowering test's and the GPU's.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from fa4_jax import gpu_target
from fa4_jax.kernels import sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction

from test_sm90_fp8 import (E4M3, assert_close_to_p_rounding, dequantized_logits,
                           dequantized_reference, fp8_inputs, sink_share)

DESCALES = ("query_descale", "key_descale", "value_descale")


def growing_inputs(b, t, s, n, kv_heads, d, seed):
  """`fp8_inputs`' operands, but with logits that grow along the keys by
  about 50 log2 units over the key length (q and k share a direction):
  the running max moves by more than the rescale threshold in most blocks,
  so a block whose O missed its alpha is off by orders of magnitude."""
  from test_sm90_fp8 import quantized

  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, n, d))
  k = rng.normal(size=(b, s, kv_heads, d))
  q[..., 0] += 10.0
  k[..., 0] += 40.0 * np.arange(s)[None, :, None] / s
  (q8, qd), (k8, kd) = quantized(q, E4M3), quantized(k, E4M3)
  v8, vd = quantized(rng.normal(size=(b, s, kv_heads, d)), E4M3)
  return (q8, k8, v8), dict(query_descale=qd, key_descale=kd, value_descale=vd)


def overlapped(d, mask, t, s, **changes):
  """The heuristic's float8 config with the overlap, on a grid of one CTA
  per tile (the interpreter's cheapest), with `changes`."""
  config = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, s, t), mask, d, d, False)
  config = dataclasses.replace(config, persistent=False, work_queue=False, q_buffers=1,
                               overlap_pv_with_softmax=True, **changes)
  return config


def forward(config, mask, d, descales, sinks=None, cap=None):
  def call(q, k, v):
    return sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(d ** -0.5, cap),
                                mask=mask,
                                config=config, sinks=sinks,
                                descales=tuple(descales[x] for x in DESCALES))[0]
  return call


@pytest.mark.parametrize("t, s, causal, changes", [
    # dense: three key blocks, the last one short; consumer 1's rows (64..)
    # are past the query length: it walks no block of its own.
    (60, 300, False, {}),
    # causal: consumers see two and three blocks (masked diagonals, full
    # blocks between), at 128-key blocks.
    (300, 300, True, dict(block_kv=128)),
    # a short key length: one block per consumer (first step, last P V).
    (120, 50, False, {}),
    # the row sums by FADDs (no ones wgmma: one commit group per P V).
    (200, 200, True, dict(block_kv=128, fp8_row_sums_on_tensor_core=False)),
    # without the consumers' turns (their barrier operations do nothing).
    (250, 260, True, dict(block_kv=128, pingpong=False)),
])
def test_overlap_matches_the_dequantized_reference(run_interpreted, t, s, causal, changes):
  d = 128
  mask = MaskSpec(right=0) if causal else MaskSpec()
  (q8, k8, v8), descales = growing_inputs(1, t, s, 2, 1, d, seed=11)
  config = overlapped(d, mask, t, s, **changes)
  assert config.overlap_pv_with_softmax and config.p_operand_in_registers
  got = run_interpreted(forward(config, mask, d, descales), q8, k8, v8)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)


def test_overlap_with_a_sink_and_192_key_blocks(run_interpreted):
  """A sink starts m and the row-sum columns (1) before the first block,
  whose alpha then rescales them; 192-key blocks (three stages)."""
  import jax.numpy as jnp

  d, t, s = 128, 130, 400
  mask = MaskSpec()
  (q8, k8, v8), descales = fp8_inputs(1, t, s, 2, 1, d, seed=12)
  sinks = jnp.asarray([0.5, 3.0], jnp.float32)
  config = overlapped(d, mask, t, s, block_kv=192, num_kv_stages=3)
  got = run_interpreted(forward(config, mask, d, descales, sinks=sinks), q8, k8, v8)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=False)
  want = want * sink_share(dequantized_logits(q8, k8, v8, descales)[0], sinks)
  assert_close_to_p_rounding(got, want, v)


@pytest.mark.parametrize("causal, cap", [(False, None), (True, None), (False, 30.0)])
def test_overlap_issues_p_v_after_the_next_q_k(cross_lower, causal, cap):
  """Cross-lowered for sm_90a: in the key-block loop the P V wgmma (register
  A operand) follows a Q K^T wgmma (SMEM A) and S is read after a wait that
  leaves the P V groups in flight (`wgmma.wait_group 2`: P V and the row
  sums' ones wgmma); also with a soft-cap (its tanh in the softmax; a
  float8 P never keeps a fixed max, `scores.fixed_max_is_exact`)."""
  d, t = 128, 1024
  mask = MaskSpec(right=0) if causal else MaskSpec()
  config = overlapped(d, mask, t, t)
  spec = jax.ShapeDtypeStruct((1, t, 2, d), E4M3)
  descales = {x: np.ones((2,), np.float32) for x in DESCALES}

  def call(q, k, v):
    with gpu_target("sm90"):
      return forward(config, mask, d, descales, cap=cap)(q, k, v)

  text = "\n".join(cross_lower(call, spec, spec, spec).modules)
  ops = re.findall(r"m64n(\d+)k32\.f32\.e4m3\.e4m3 \{[$\d,]+\}, (\S)"
                   r"|wait_group\.sync\.aligned (\d)", text)
  seq = [f"n{n}{'r' if a == '{' else 's'}" if n else f"w{w}" for n, a, w in ops]
  runs = [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]  # one per wgmma
  # S = Q K^T (SMEM A), P V (register A), the ones wgmma, then the S-only wait.
  assert "n128s n128r n8r w2" in " ".join(runs), runs


def test_overlap_with_a_sliding_window(run_interpreted):
  """A window of 40 keys to the left: a consumer's own blocks may start after
  the CTA's first block (skip steps before its first block, as well as
  after its last), rows 256.. see blocks 1 and 2 only."""
  d, t = 128, 300
  mask = MaskSpec(left=40, right=0)
  (q8, k8, v8), descales = growing_inputs(1, t, t, 2, 1, d, seed=13)
  config = overlapped(d, mask, t, t, block_kv=128)
  got = run_interpreted(forward(config, mask, d, descales), q8, k8, v8)
  logits, v = dequantized_logits(q8, k8, v8, descales)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  logits = np.where((j <= i) & (j >= i - 40), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("bnts,bsnd->btnd", w / w.sum(-1, keepdims=True), v)
  assert_close_to_p_rounding(got, want, v)


def test_overlap_with_soft_cap_bottom_right_causal_and_key_lengths(run_interpreted):
  """The heuristic's causal config (no turns) on what it also serves at long
  lengths: a soft-cap (its tanh in the overlapped softmax), queries aligned
  bottom-right, and per-row key lengths (a row of 190 keys, one of 77:
  masked edge blocks, and consumers whose rows see no key)."""
  import jax.numpy as jnp

  d, t, s, cap = 128, 130, 190, 20.0
  lengths = np.asarray([190, 77], np.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True)
  (q8, k8, v8), descales = growing_inputs(2, t, s, 2, 1, d, seed=14)
  config = overlapped(d, mask, t, s, block_kv=128, pingpong=False)

  def call(q, k, v):
    # bottom-right with lengths: each row's offset is kv_len - q_len, so the
    # query lengths are given too (`validation._align` fills them with t)
    return sm90_forward.forward(q, k, v, jnp.full((2,), t, jnp.int32), jnp.asarray(lengths),
                                score=ScoreFunction(d ** -0.5, cap), mask=mask, config=config,
                                descales=tuple(descales[x] for x in DESCALES))[0]

  got = np.asarray(run_interpreted(call, q8, k8, v8), np.float32)
  logits, v = dequantized_logits(q8, k8, v8, descales)
  logits = cap * np.tanh(logits / cap)
  i, j = np.arange(t)[None, :, None], np.arange(s)[None, None, :]
  position = lengths[:, None, None] - t + i  # each query's place among its row's keys
  visible = (j <= position) & (j < lengths[:, None, None])  # [B, t, s]
  logits = np.where(visible[:, None], logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  w = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
  total = w.sum(-1, keepdims=True)
  want = np.einsum("bnts,bsnd->btnd", w / np.where(total > 0, total, 1.0), v)
  assert_close_to_p_rounding(got, want, v)
  sees_nothing = ~visible.any(-1)  # row 1's first 53 queries
  assert sees_nothing[1, :53].all() and not sees_nothing[0].any()
  assert (got[1, :53] == 0).all()
