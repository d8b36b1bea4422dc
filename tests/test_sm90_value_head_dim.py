"""The Hopper forward kernel with a value head dim of its own (`v` [B, S, K,
Dv], out [B, T, N, Dv]: DeepSeek's 192 / 128 and others), on the CPU.

* Numerics and barrier protocol: the kernel in Pallas' GPU interpreter with
  race detection, small and odd shapes, against an f32 einsum
  (`reference.einsum_attention`). The kernel rounds P to the inputs' dtype
  before P V: outputs at 2e-2 in bf16, the lse (f32 throughout) at 1e-3.
* Hardware fit: the configurations the heuristic picks for 192 / 128 and
  128 / 64 (one CTA per tile and the persistent grid) cross-lowered for
  sm_90: wgmma, TMA, the SMEM the config accounts for.
* The public path: `fa4_jax.attention(..., implementation="sm90")` runs the
  kernel forward and the kernel backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.kernels import sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import einsum_attention, relative_error

CAUSAL = MaskSpec(right=0)


def inputs(b, t, s, n, k, d, dv, dtype=jnp.bfloat16, seed=0):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return make(b, t, n, d), make(b, s, k, d), make(b, s, k, dv)


def visible(t, s, causal, kv_lengths=None):
  rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
  keep = (cols <= rows) if causal else np.ones((t, s), bool)
  keep = keep[None, None]
  if kv_lengths is not None:
    keep = keep & (cols[None, None] < np.asarray(kv_lengths)[:, None, None, None])
  return keep


@pytest.mark.parametrize("d, dv, causal", [(64, 128, True), (128, 64, False), (192, 128, True),
                                           (48, 80, False)])  # padded to 64 / 128
def test_forward_matches_einsum(run_interpreted, d, dv, causal):
  b, t, s, n, k = 2, 70, 90 if not causal else 70, 4, 2
  q, key, v = inputs(b, t, s, n, k, d, dv)
  kv_lengths = jnp.asarray([s, s - 23], jnp.int32)
  out, lse = run_interpreted(
      lambda q, key, v, kl: sm90_forward.forward(q, key, v, None, kl,
                                                 score=ScoreFunction(d ** -0.5),
                                                 mask=CAUSAL if causal else MaskSpec()),
      q, key, v, kv_lengths)
  want, want_lse = einsum_attention(q, key, v, visible(t, s, causal, kv_lengths))
  assert out.shape == (b, t, n, dv)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_persistent_grid_with_its_own_o_tiles(run_interpreted):
  # Short rows take the persistent grid, whose O tiles are separate anyway.
  q, key, v = inputs(1, 256, 256, 2, 1, 64, 128, seed=1)
  config = sm90_forward.choose_config(128, CAUSAL, 256, 256)
  assert config.persistent
  out, lse = run_interpreted(
      lambda q, key, v: sm90_forward.forward(q, key, v, None, None, score=ScoreFunction(0.125),
                                             mask=CAUSAL),
      q, key, v)
  want, want_lse = einsum_attention(q, key, v, visible(256, 256, True), scale=0.125)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("d, dv", [(128, 64), (64, 128)])
def test_attention_runs_the_kernel_forward_and_backward(run_interpreted, d, dv):
  """The backward kernels take 128 / 64 as it is; at 64 / 128 (V wider than
  K: `sm90_backward.check_value_head_dim`) the narrower side is zero-padded
  to the wider (`backends._one_head_dim`) and its gradients sliced back
  (tests/test_sm90_backward_value_head_dim.py: which pairs take which)."""
  q, key, v = inputs(1, 64, 64, 2, 1, d, dv, dtype=jnp.float16, seed=2)
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, key, v, implementation="sm90") == "sm90"
    assert fa4_jax.which_implementation(q, key, v, implementation="sm90",
                                        part="backward") == "sm90"
  weights = jnp.arange(dv, dtype=jnp.float32)  # a cotangent that differs per column
  loss = lambda q, key, v: (fa4_jax.attention(q, key, v, is_causal=True, implementation="sm90")
                            .astype(jnp.float32) * weights).sum()
  ref = lambda q, key, v: einsum_attention(q, key, v, visible(64, 64, True))[0]
  got = run_interpreted(jax.grad(loss, argnums=(0, 1, 2)), q, key, v)
  want = jax.grad(lambda q, key, v: (ref(q, key, v) * weights).sum(),
                  argnums=(0, 1, 2))(q, key, v)
  # float16 operands, P and dS rounded to float16 (2^-11 relative) in the
  # kernel: well within 5e-3 over all elements (a few single elements lose
  # more to cancellation).
  for g, w, x in zip(got, want, (q, key, v)):
    assert g.shape == x.shape
    assert relative_error(g, w) < 5e-3, relative_error(g, w)


def test_the_decode_arrangement_and_pages_keep_equal_head_dims():
  q, key, v = inputs(2, 1, 256, 8, 2, 128, 64)
  with fa4_jax.gpu_target("sm90"):  # a short query, no band: decode would take it
    assert fa4_jax.which_implementation(q, key, v) == "sm90"
  with pytest.raises(Exception, match="page table or heads-major"):
    sm90_forward.check_value_head_dim((8, 16, 2, 128), (8, 16, 2, 64), jnp.zeros((2, 4)), False)
  for bad in (320, 72):
    with pytest.raises(Exception, match="a multiple of 16 up to 256"):
      sm90_forward.check_value_head_dim((2, 16, 2, 128), (2, 16, 2, bad), None, False)


@pytest.mark.parametrize("d, dv, kv_seq", [(192, 128, 8192), (128, 64, 8192), (64, 128, 512)])
def test_heuristic_configs_cross_lower(cross_lower, d, dv, kv_seq):
  q = jax.ShapeDtypeStruct((2, kv_seq, 4, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, kv_seq, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, kv_seq, 2, dv), jnp.bfloat16)
  fn = lambda q, k, v: sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(0.1),
                                            mask=CAUSAL)
  lowered = cross_lower(fn, q, k, v, arch="sm_90")
  assert lowered.has("wgmma.mma_async") and lowered.has("cp.async.bulk.tensor")
  config = sm90_forward.value_head_dim_config(
      sm90_forward.choose_config(max(d, dv), CAUSAL, kv_seq, kv_seq), d, dv)
  if not config.fits_smem(d, 2, False, dv):
    config = config.__class__(**{**config.__dict__, "q_buffers": 1})
  estimate = config.smem_bytes(d, 2, False, dv)
  assert estimate <= lowered.max_smem_bytes <= estimate + sm90_forward.SMEM_RESERVE_BYTES
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
