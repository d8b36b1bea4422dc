"""The 192 / 128 forward's configuration (issue #56), on the CPU.

`sm90_forward.value_head_dim_config` gives 192 / 128 128-key blocks with
O in the Q tile: `ForwardConfig.o_in_q_tile` stages O (128 wide) in the bytes of the
consumer's Q tile (192 wide) instead of in tiles of its own, which frees
the 32 KiB that 128-key blocks on two stages need at 192 / 128 (the D = 128
forward's blocks). Checked here: the kernel in Pallas' GPU interpreter with
race detection (dense with GQA, kv lengths and odd lengths; causal) against
an f32 einsum, the SMEM it lowers to against `ForwardConfig.smem_bytes`,
that equal head dims and the persistent grid ignore the option, and that
the rule takes it at 192 / 128 alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.kernels import sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import einsum_attention

D, DV = 192, 128
CAUSAL = MaskSpec(right=0)


def _config(mask, **changes):
  return dataclasses.replace(sm90_forward.choose_config(D, mask), o_in_q_tile=True, **changes)


def _visible(t, s, causal, kv_lengths):
  rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
  keep = ((cols <= rows) if causal else np.ones((t, s), bool))[None, None]
  return keep & (cols[None, None] < np.asarray(kv_lengths)[:, None, None, None])


@pytest.mark.parametrize("causal", [False, True])
def test_o_in_q_tile_on_128_key_blocks_matches_einsum(run_interpreted, causal):
  b, t, s, n, k = 2, 75, (75 if causal else 200), 2, 1
  rng = np.random.default_rng(3)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, key, v = make(b, t, n, D), make(b, s, k, D), make(b, s, k, DV)
  kv_lengths = jnp.asarray([s, s - 37], jnp.int32)
  mask = CAUSAL if causal else MaskSpec()
  config = _config(mask, block_kv=128)
  out, lse = run_interpreted(
      lambda q, key, v, kl: sm90_forward.forward(q, key, v, None, kl, score=ScoreFunction(D ** -0.5),
                                                 mask=mask, config=config),
      q, key, v, kv_lengths)
  want, want_lse = einsum_attention(q, key, v, _visible(t, s, causal, kv_lengths))
  assert out.shape == (b, t, n, DV)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("block_kv, stages", [(64, 2), (128, 2)])
def test_o_in_q_tile_frees_the_o_tiles_smem(cross_lower, block_kv, stages):
  config = _config(MaskSpec(), block_kv=block_kv, num_kv_stages=stages)
  separate = dataclasses.replace(config, o_in_q_tile=False)
  saved = separate.smem_bytes(D, 2, value_head_dim=DV) - config.smem_bytes(D, 2, value_head_dim=DV)
  assert saved == config.num_consumers * config.block_q * DV * 2
  assert config.fits_smem(D, 2, value_head_dim=DV)
  q = jax.ShapeDtypeStruct((1, 1024, 2, D), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1024, 2, DV), jnp.bfloat16)
  lowered = cross_lower(
      lambda q, k, v: sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(0.1),
                                           mask=MaskSpec(), config=config)[0], q, q, v)
  assert lowered.has("cp.async.bulk.tensor")
  accounted = config.smem_bytes(D, 2, value_head_dim=DV)
  assert accounted <= lowered.max_smem_bytes <= min(
      accounted + sm90_forward.SMEM_RESERVE_BYTES, SMEM_LIMIT_BYTES), lowered.smem_bytes


def test_o_in_q_tile_leaves_other_calls_alone():
  config = dataclasses.replace(sm90_forward.choose_config(128, MaskSpec()), o_in_q_tile=True)
  # Equal head dims stage O in the Q tile anyway; the persistent grid and V
  # wider than K keep O's own tiles.
  assert config.smem_bytes(128, 2) == dataclasses.replace(config, o_in_q_tile=False).smem_bytes(
      128, 2)
  persistent = dataclasses.replace(config, persistent=True)
  assert persistent.smem_bytes(192, 2, value_head_dim=128) == dataclasses.replace(
      persistent, o_in_q_tile=False).smem_bytes(192, 2, value_head_dim=128)
  assert sm90_forward.o_rows_in_q_tile(64, 64, 128) == 0
  assert sm90_forward.o_rows_in_q_tile(64, 192, 128) == 96
  assert sm90_forward.o_rows_in_q_tile(64, 128, 64) == 128
  assert not sm90_forward.choose_config(D, MaskSpec()).o_in_q_tile  # the rule's, not the 192's


@pytest.mark.parametrize("mask", [MaskSpec(), MaskSpec(right=0)], ids=["dense", "causal"])
def test_192_128_takes_128_key_blocks_with_o_in_the_q_tile(mask):
  """`value_head_dim_config` (measured on an H100: 757 / 738 against 645 /
  641 TFLOP/s dense / causal): 192 / 128 alone; other pairs keep their rule."""
  base = sm90_forward.choose_config(D, mask)
  config = sm90_forward.value_head_dim_config(base, D, 128)
  assert (config.block_kv, config.o_in_q_tile, config.sum_before_handoff) == (128, True, False)
  assert config.fits_smem(D, 2, False, 128)
  for d, dv in [(192, 192), (192, 64), (128, 64), (256, 128), (64, 64)]:
    other = sm90_forward.choose_config(d, mask)
    assert sm90_forward.value_head_dim_config(other, d, dv) == other
