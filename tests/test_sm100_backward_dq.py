"""The Blackwell (sm_100) dQ kernel (fa4_jax/kernels/sm100_backward_dq.py), on the CPU.

* Interpretation: the kernel runs in Pallas' GPU interpreter with the race
  detector on (TMEM, SMEM, barriers and tcgen05 MMAs simulated). Its dQ must
  match jax.vjp of an f32 einsum attention under the explicit boolean mask
  (tests/reference.py), given lse2 and delta that `sm90_backward._preprocess`
  makes from that reference's out and lse, as the backward will. Rows that
  see no key get exactly zero, finite gradients.
* Determinism: two runs are bit-identical (every dQ element has one writer).
* Cross-lowering for sm_100: every tiling `dq_tiles` picks, under every mask
  kind, lowers with tcgen05 MMAs and TMEM loads, without wgmma, within the
  SMEM and TMEM budgets.
* The barrier table: every `DqBarriers` accessor is named in its docstring's
  table, and every barrier is both arrived on and waited on.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import sm100_backward_dq as dq_kernel
from fa4_jax.kernels.sm90_backward import _preprocess, segment_operands
from fa4_jax.scores import MaskSpec, cdiv
from fa4_jax.testing import SMEM_LIMIT_BYTES, TMEM_COLUMNS
from reference import KernelCase, einsum_attention, packed_segment_ids


@dataclasses.dataclass(frozen=True)
class Case(KernelCase):
  soft_cap: float | None = None
  # Bottom-right alignment by the lengths (`MaskSpec.offset_from_lengths`):
  # each batch row's last valid query sits on its last valid key.
  aligned_by_lengths: bool = False

  @property
  def mask(self) -> MaskSpec:
    return dataclasses.replace(super().mask, offset_from_lengths=self.aligned_by_lengths)

  def visible(self) -> np.ndarray:
    if not self.aligned_by_lengths:
      return super().visible()
    rows = []
    for i in range(self.batch):  # one offset per batch row: kv_len - q_len
      q_len = self.q_seq if self.q_lengths is None else self.q_lengths[i]
      kv_len = self.kv_seq if self.kv_lengths is None else self.kv_lengths[i]
      row = dataclasses.replace(self, batch=1, aligned_by_lengths=False,
                                q_offset=self.q_offset + kv_len - q_len,
                                q_lengths=(q_len,), kv_lengths=(kv_len,))
      rows.append(row.visible())
    return np.concatenate(rows)


def _inputs(case: Case, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 4)
  dtype = jnp.dtype(case.dtype)
  q_shape = (case.batch, case.q_seq, case.q_heads, case.head_dim)
  kv_shape = (case.batch, case.kv_seq, case.kv_heads, case.head_dim)
  q = jax.random.normal(keys[0], q_shape, dtype)
  k = jax.random.normal(keys[1], kv_shape, dtype)
  v = 1.0 + jax.random.normal(keys[2], kv_shape, dtype)
  dout = jax.random.normal(keys[3], q_shape, dtype)
  return q, k, v, dout


def _reference(case: Case, q, k, v, dout, scale):
  """(out, lse, dq) of the f32 einsum attention under the explicit mask."""
  f32 = lambda x: x.astype(jnp.float32)
  visible = case.visible()
  attend = lambda q: einsum_attention(q, f32(k), f32(v), visible, scale=scale,
                                      soft_cap=case.soft_cap)
  (out, lse), vjp = jax.vjp(attend, f32(q))
  (dq,) = vjp((f32(dout), jnp.zeros_like(lse)))
  return out, lse, dq


def _kernel_dq(case: Case, q, k, v, dout, out, lse, scale, run):
  """The kernel's dQ, its inputs prepared as the sm100 backward will."""
  q_len, kv_len = case.lengths()
  b, tq, nq, d = q.shape
  tk, nkv = k.shape[1], k.shape[2]
  q_pad, kv_pad = cdiv(tq, 8) * 8, cdiv(tk, 8) * 8
  tiles = dq_kernel.dq_tiles(d, q.dtype)
  lse2, delta = _preprocess(out, lse, dout, q_len, q_pad)
  pad = lambda x, t: jnp.pad(x, [(0, 0), (0, t - x.shape[1]), (0, 0), (0, 0)])
  lengths = [x for x in (q_len, kv_len) if x is not None]
  segments = []
  if case.segment_ids() is not None:
    segments = segment_operands(*case.segment_ids(), keys_are_rows=False,
                                block_rows=tiles.block_q, consumers=1,
                                num_ctas=cdiv(q_pad, tiles.block_q), block_cols=tiles.block_kv)
  kernel = lambda: dq_kernel.build_dq_kernel(
      batch=b, q_seq=q_pad, kv_seq=kv_pad, kv_valid=tk, num_q_heads=nq, num_kv_heads=nkv,
      head_dim=d, dtype=q.dtype, scale=scale, mask=case.mask, block_kv=tiles.block_kv,
      block_q=tiles.block_q, num_stages=tiles.num_stages, has_q_lengths=q_len is not None,
      has_kv_lengths=kv_len is not None, has_segments=bool(segments), soft_cap=case.soft_cap)
  args = (pad(q, q_pad), pad(k, kv_pad), pad(v, kv_pad), pad(dout, q_pad), lse2, delta,
          *lengths, *segments)
  dq = run(lambda *a: kernel()(*a), *args)
  assert dq.shape == (b, q_pad, nq, d) and dq.dtype == q.dtype
  return dq[:, :tq]


def _check(case: Case, run_interpreted):
  q, k, v, dout = _inputs(case)
  scale = 1.0 / math.sqrt(case.head_dim)
  out, lse, expected = _reference(case, q, k, v, dout, scale)
  got = np.asarray(_kernel_dq(case, q, k, v, dout, out, lse, scale, run_interpreted), np.float32)
  expected = np.asarray(expected)
  assert np.isfinite(got).all()
  # Rows that see no key (past q_lengths, or every key masked): exactly 0.
  dead = ~case.visible().any(-1)[:, 0, :]  # [B, Tq]
  np.testing.assert_array_equal(got[dead], 0.0)
  # bf16/fp16 operands of the GEMMs against an f32 reference: the error
  # relative to the gradient's overall size (as the sm90 backward's tests).
  rel = np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-6)
  assert rel < (2e-2 if case.dtype == "bfloat16" else 5e-3), rel
  np.testing.assert_allclose(got, expected, atol=5e-2 * np.abs(expected).max(), rtol=5e-2)
  return got


_DOCS = packed_segment_ids
_ids = lambda *rows: tuple(tuple(int(x) for x in r) for r in rows)

# Small cases (the interpreter takes seconds per call), several features each.
CASES = {
    # Step 1: no mask, two Q tiles, many key blocks (both score buffers, the
    # K/V ring wraps), ragged tails left to TMA.
    "dense_head_dim_64": Case(q_seq=256, kv_seq=320),
    "dense_head_dim_128_ragged_tails": Case(head_dim=128, q_seq=200, kv_seq=136),
    # Step 2: causal (heavy tiles first, blocks above the diagonal skipped,
    # the element mask on the diagonal blocks only), GQA.
    "causal_gqa": Case(is_causal=True, q_seq=256, kv_seq=256, q_heads=4, kv_heads=2),
    "mqa_head_dim_128_causal_queries_shorter_than_keys": Case(
        head_dim=128, is_causal=True, q_seq=72, kv_seq=200, q_heads=3, kv_heads=1),
    # Lengths: rows past q_len and a batch row with no keys at all (zero,
    # finite dQ; its CTAs walk nothing and store zeros).
    "lengths_rows_that_see_no_key": Case(
        batch=2, is_causal=True, q_seq=200, kv_seq=136, q_lengths=(150, 200),
        kv_lengths=(136, 0)),
    # Bottom-right alignment by a fixed offset: rows before the first key
    # see nothing.
    "causal_bottom_right_offset": Case(is_causal=True, q_seq=192, kv_seq=128, q_offset=-64),
    # Bottom-right alignment by each row's lengths (chunked prefill), with a window.
    "window_aligned_by_lengths": Case(
        batch=2, is_causal=True, window=(48, 0), q_seq=136, kv_seq=264, q_lengths=(136, 40),
        kv_lengths=(264, 200), aligned_by_lengths=True),
    # Step 3: a two-sided window skips far key blocks on both sides; fp16.
    "float16_two_sided_window": Case(dtype="float16", window=(40, 20), q_seq=200, kv_seq=330),
    "head_dim_128_causal_window_soft_cap": Case(
        head_dim=128, is_causal=True, window=(100, 0), q_seq=256, kv_seq=256, soft_cap=2.0),
    # Segment ids: documents packed one after the other (tiles skipped, one-id
    # blocks unmasked), GQA; an id the keys lack (rows that see no key).
    "segments_packed_causal_gqa": Case(
        is_causal=True, q_seq=256, kv_seq=256, q_heads=2, kv_heads=1,
        q_segment_ids=_ids(_DOCS([100, 60, 96], 256)),
        kv_segment_ids=_ids(_DOCS([100, 60, 96], 256))),
    "segments_interleaved_and_absent_ids_lengths": Case(
        batch=2, q_seq=136, kv_seq=200, q_lengths=(136, 100), kv_lengths=(150, 200),
        q_segment_ids=_ids(np.arange(136) % 3, np.r_[np.zeros(70), np.full(66, 5)]),
        kv_segment_ids=_ids(np.arange(200) // 2 % 3, np.zeros(200))),
    # head_dim 256: dQ takes half the TMEM; 32-key blocks.
    "head_dim_256_causal_ragged": Case(head_dim=256, is_causal=True, q_seq=136, kv_seq=100),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dq_matches_the_f32_reference_without_races(name, run_interpreted):
  _check(CASES[name], run_interpreted)
