"""The Hopper backward kernels with a value head dim of their own (V, O, dO
and dV Dv wide beside Q, K, dQ and dK at D: DeepSeek's 192 / 128, and 128 /
64), on the CPU.

* Numerics and barrier protocol: the kernels in Pallas' GPU interpreter with
  race detection, at small shapes (dense, causal, GQA, kv lengths), against
  jax.grad of an f32 einsum attention (`reference.einsum_attention`;
  jax.nn's takes one head dim); one case soft-capped. Each scheme the
  heuristic picks for a pair runs once: two passes (192 / 128), the fused
  kernel (128 / 64, 192 / 64) and the head-dim split (256 / 128).
* Hardware fit: every configuration the heuristic picks for 192 / 128 and
  128 / 64 cross-lowered for sm_90: within the SMEM limit, and the dV GEMM's
  N is Dv (no GEMM as wide as a zero-padded dV).
* The public path: `backends` hands the sm90 backward Dv-wide operands
  (no `_one_head_dim`) for the pairs it takes, and pads the others.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends
from fa4_jax.kernels import KernelUnsupported, sm90_backward, sm90_tiles
from fa4_jax.scores import MaskSpec, ScoreFunction
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import einsum_attention, relative_error, visible_mask

CAUSAL = MaskSpec(right=0)


def _inputs(b, t, s, n, k, d, dv, seed=0):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  return make(b, t, n, d), make(b, s, k, d), make(b, s, k, dv), make(b, t, n, dv)


# (d, dv, causal, query heads, kv heads, kv lengths, soft-cap): small enough
# for the interpreter, each scheme once, the pairs of the issue under both
# masks.
CASES = {
    "192_128_dv_dk_split_dense_kv_lengths": (192, 128, False, 2, 1, (96, 57), None),
    "192_128_dv_dk_split_causal_gqa_soft_cap": (192, 128, True, 4, 2, None, 20.0),
    "128_64_fused_dense_gqa_kv_lengths": (128, 64, False, 4, 2, (96, 70), None),
    "128_64_fused_causal_delta_in_dq": (128, 64, True, 2, 1, None, None),
    "192_64_fused": (192, 64, True, 2, 1, None, None),
    "256_128_head_dim_split": (256, 128, False, 2, 1, None, None),
}


def check_gradients(run_interpreted, shape, d, dv, causal, kv_lengths, soft_cap, config=None):
  """dq, dk, dv of the sm90 backward (`config`, or the heuristic's) in the
  interpreter against jax.grad of an f32 einsum attention; `shape`: (b, t,
  s, query heads, kv heads)."""
  b, t, s, n, k = shape
  q, key, v, dout = _inputs(b, t, s, n, k, d, dv)
  mask = CAUSAL if causal else MaskSpec()
  kv_len = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
  visible = visible_mask(t, s, is_causal=causal, kv_lengths=kv_lengths, batch=b)
  scale = d ** -0.5
  out, lse = einsum_attention(q, key, v, visible, scale=scale, soft_cap=soft_cap)
  grads = run_interpreted(
      lambda *xs: sm90_backward.backward(*xs, None, kv_len, score=ScoreFunction(scale, soft_cap),
                                         mask=mask, config=config),
      q, key, v, out.astype(q.dtype), lse, dout)
  loss = lambda q, key, v: (einsum_attention(q, key, v, visible, scale=scale,
                                             soft_cap=soft_cap)[0]
                            * dout.astype(jnp.float32)).sum()
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.grad(loss, argnums=(0, 1, 2))(f32(q), f32(key), f32(v))
  # bf16 operands, P and dS rounded to bf16 (2^-9 relative rounding error
  # each) before their GEMMs, f32 accumulation: 2-3e-3 over all elements
  # (measured 2.2e-3 to 2.6e-3), so 1e-2 leaves room for the rounding and
  # none for a wrong column block of any gradient.
  for g_name, got, w, x in zip(("dq", "dk", "dv"), grads, want, (q, key, v)):
    assert got.shape == x.shape and got.dtype == x.dtype, g_name
    assert relative_error(got, w) < 1e-2, (g_name, relative_error(got, w))


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_an_f32_einsum(run_interpreted, name):
  d, dv, causal, n, k, kv_lengths, soft_cap = CASES[name]
  b, t, s = (1, 128, 128) if kv_lengths is None else (2, 80, 96)
  check_gradients(run_interpreted, (b, t, s, n, k), d, dv, causal, kv_lengths, soft_cap)


def _wgmma_widths(module: str) -> collections.Counter:
  """The N of every wgmma instruction of a lowered kernel module."""
  return collections.Counter(
      int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", module))


def _heuristic_cases(d, dv):
  """One call per distinct config `choose_config` picks for the pair."""
  seen = {}
  for mask in sm90_tiles.HEURISTIC_MASKS:
    for group in (1, 4):
      for soft_cap in (False, True):
        config = sm90_backward.choose_config(d, mask, group, raw_scores=soft_cap,
                                             value_head_dim=dv)
        seen.setdefault(config, (mask, group, 50.0 if soft_cap else None))
  return list(seen.items())


def _lower_backward(cross_lower, config, mask, group, soft_cap, d, dv):
  q = jax.ShapeDtypeStruct((1, 1024, 2 * group, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1024, 2, dv), jnp.bfloat16)
  o = jax.ShapeDtypeStruct((1, 1024, 2 * group, dv), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2 * group, 1024), jnp.float32)
  fn = lambda q, k, v, o, lse, do: sm90_backward.backward(
      q, k, v, o, lse, do, None, None, score=ScoreFunction(0.1, soft_cap), mask=mask,
      config=config)
  return cross_lower(fn, q, k, v, o, lse, o, arch="sm_90")


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64)])
def test_heuristic_configs_cross_lower_with_dv_wide_gemms(cross_lower, d, dv):
  for config, (mask, group, soft_cap) in _heuristic_cases(d, dv):
    lowered = _lower_backward(cross_lower, config, mask, group, soft_cap, d, dv)
    assert lowered.has("cp.async.bulk.tensor"), config
    assert 0 < lowered.max_smem_bytes <= SMEM_LIMIT_BYTES, (config, lowered.smem_bytes)
    widths = [_wgmma_widths(m) for m in lowered.modules]
    # Every wgmma is N = 64 (S, dP and their transposes at 64-row or 64-key
    # blocks), D wide (dQ, dK) or Dv wide (dV).
    assert all(set(w) <= {64, d, dv} for w in widths), (config, widths)
    # The same config on V zero-padded to D (what `backends` did before):
    # its dV GEMMs are D wide too, the native kernels' are not.
    padded = [_wgmma_widths(m) for m in
              _lower_backward(cross_lower, config, mask, group, soft_cap, d, d).modules]
    d_wide, padded_d_wide = sum(w[d] for w in widths), sum(w[d] for w in padded)
    assert 0 < d_wide < padded_d_wide, (config, widths, padded)
    if config.dkv.dk_dv == "two_passes":
      # The dV pass: S^T and dV only, nothing D wide.
      assert any(set(w) == {64, dv} for w in widths), (config, widths)


def test_backends_hands_the_sm90_backward_dv_wide_operands(monkeypatch):
  """At 192 / 128 and 128 / 64 the backward kernels get V, O and dO as they
  are (no `_one_head_dim`); at 64 / 128 (V wider than K) and 256 / 64 (dV
  halves off the 64-column tiles) they get them padded."""
  seen = []
  real = sm90_backward.backward

  def spy(q, k, v, out, lse, dout, *args, **kwargs):
    seen.append((q.shape[-1], k.shape[-1], v.shape[-1], out.shape[-1], dout.shape[-1]))
    return real(q, k, v, out, lse, dout, *args, **kwargs)

  monkeypatch.setattr(sm90_backward, "backward", spy)
  for d, dv, native in ((192, 128, True), (128, 64, True), (64, 128, False), (256, 64, False)):
    q, key, v, _ = _inputs(1, 64, 64, 2, 1, d, dv)
    with fa4_jax.gpu_target("sm90"):
      assert fa4_jax.which_implementation(q, key, v, implementation="sm90",
                                          part="backward") == "sm90"
      grad = jax.grad(lambda q, key, v: fa4_jax.attention(q, key, v, implementation="sm90")
                      .astype(jnp.float32).sum(), argnums=(0, 1, 2))
      shapes = jax.eval_shape(grad, q, key, v)
    assert [x.shape for x in shapes] == [q.shape, key.shape, v.shape]
    wide = max(d, dv)
    assert seen.pop() == ((d, d, dv, dv, dv) if native else (wide,) * 5), (d, dv)
    assert backends._pads_value_head_dim(sm90_backward, d, dv) is not native


def test_value_head_dims_the_kernels_do_not_take_are_refused_explicitly():
  for d, dv in ((64, 128), (128, 192), (256, 64), (256, 192), (128, 72)):
    with pytest.raises(KernelUnsupported, match="value head dim"):
      sm90_backward.check_value_head_dim(d, dv)
  for d, dv in ((192, 128), (128, 64), (192, 64), (256, 128), (128, 128), (112, 96), (192, 80)):
    sm90_backward.check_value_head_dim(d, dv)
