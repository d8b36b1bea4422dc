"""MaskSpec's tile questions agree with its element rule, checked exhaustively.

Kernels and the XLA path skip tiles and drop element masks based on these
answers, so a wrong answer here means silently wrong attention.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.scores import MaskSpec, key_length_to_compare

T, S, BQ, BK = 37, 45, 8, 8
SPECS = [
    MaskSpec(),
    MaskSpec.from_arguments(True, None),
    MaskSpec.from_arguments(False, (5, 3)),
    MaskSpec.from_arguments(True, (9, 4)),
    MaskSpec.from_arguments(False, (0, 0)),
    MaskSpec(left=None, right=0, q_offset=S - T),  # bottom-right causal alignment
    MaskSpec(left=3, right=None, q_offset=-4),
]


def element_rule(spec):
  return np.asarray(spec.visible(jnp.arange(T)[:, None], jnp.arange(S)[None, :]))


def brute_force(spec):
  i, j = np.arange(T)[:, None] + spec.q_offset, np.arange(S)[None, :]
  ok = np.ones((T, S), bool)
  if spec.left is not None:
    ok &= j >= i - spec.left
  if spec.right is not None:
    ok &= j <= i + spec.right
  return ok


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_element_rule_is_the_documented_band(spec):
  np.testing.assert_array_equal(element_rule(spec), brute_force(spec))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_key_blocks_cover_exactly_the_visible_blocks(spec):
  ok = brute_force(spec)
  for qb in range(-(-T // BQ)):
    rows = ok[qb * BQ:(qb + 1) * BQ]
    touched = {j // BK for j in np.nonzero(rows.any(0))[0]}
    lo, hi = spec.key_block_range(qb * BQ, min((qb + 1) * BQ, T), S, BK)
    assert touched <= set(range(lo, hi))
    # Tight: no block at either end of the range is fully masked.
    if touched:
      assert (lo, hi) == (min(touched), max(touched) + 1)
    else:
      assert lo >= hi


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_query_blocks_cover_exactly_the_rows_that_see_a_key_block(spec):
  ok = brute_force(spec)
  for kb in range(-(-S // BK)):
    cols = ok[:, kb * BK:(kb + 1) * BK]
    touched = {i // BQ for i in np.nonzero(cols.any(1))[0]}
    lo, hi = spec.query_block_range(kb * BK, min((kb + 1) * BK, S), T, BQ)
    assert touched <= set(range(lo, hi))
    if touched:
      assert (lo, hi) == (min(touched), max(touched) + 1)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_full_tiles_are_exactly_the_tiles_without_masked_elements(spec):
  ok = brute_force(spec)
  for qb, kb in itertools.product(range(-(-T // BQ)), range(-(-S // BK))):
    q_lo, q_hi = qb * BQ, min((qb + 1) * BQ, T)
    k_lo, k_hi = kb * BK, min((kb + 1) * BK, S)
    assert bool(spec.tile_is_full(q_lo, q_hi, k_lo, k_hi)) == ok[q_lo:q_hi, k_lo:k_hi].all()


def test_tile_helpers_accept_traced_scalars():
  spec = MaskSpec.from_arguments(True, (9, 4))
  lo, hi = spec.key_block_range(jnp.int32(16), jnp.int32(24), jnp.int32(S), BK)
  assert (int(lo), int(hi)) == spec.key_block_range(16, 24, S, BK)


def test_causal_with_a_window_keeps_only_the_past_side():
  assert MaskSpec.from_arguments(True, (4, 6)) == MaskSpec(left=4, right=0)
  assert MaskSpec.from_arguments(True, None).is_causal
  assert MaskSpec().is_dense


def test_the_key_length_compare_is_dropped_only_where_no_walked_key_lies_past_it():
  causal = MaskSpec.from_arguments(True, None)
  # Segment-id kernel, a static length that ends a block: every block the
  # kernel walks lies below it, so the compare could never fail.
  assert key_length_to_compare(4 * BK, BK, causal, segment_ids=True) is None
  # Every other case compares: a length inside a block (padded keys follow
  # it), a length known only at run time, a mask aligned by the lengths,
  # and the kernels without segment ids (their measured choice).
  assert key_length_to_compare(4 * BK + 3, BK, causal, segment_ids=True) == 4 * BK + 3
  traced = jnp.int32(4 * BK)
  assert key_length_to_compare(traced, BK, causal, segment_ids=True) is traced
  aligned = MaskSpec(right=0, offset_from_lengths=True)
  assert key_length_to_compare(4 * BK, BK, aligned, segment_ids=True) == 4 * BK
  assert key_length_to_compare(4 * BK, BK, causal, segment_ids=False) == 4 * BK
