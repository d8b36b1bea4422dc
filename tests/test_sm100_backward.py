"""The Blackwell backward as users reach it: `jax.grad` of `fa4_jax.attention`
with the sm100 kernels (issue #29), without a GPU.

* `which_implementation(..., part="backward")` names the sm100 backward for a
  Blackwell target where its kernels serve the call, and the XLA backward
  where they do not (head dim 256).
* Cross-lowered for sm_100, the gradient of an sm100 call holds three
  tcgen05 kernels (forward, dK/dV, dQ) and no wgmma; at head dim 256 only
  the forward's.
* Interpreted with race detection, the gradients of `fa4_jax.attention`
  match those of an f32 einsum attention with the mask built the naive way.
The kernels' own feature matrices are in tests/test_sm100_backward_dkdv.py
and tests/test_sm100_backward_dq.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import reference

# bf16 inputs: P and dS are rounded to 16 bits before their MMAs.
GRAD_TOL = 2e-2


def _qkv(seed, b, t, n, kv_heads, d, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  shapes = [(b, t, n, d), (b, t, kv_heads, d), (b, t, kv_heads, d), (b, t, n, d)]
  return [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]


@pytest.mark.parametrize("head_dim, soft_cap, want", [
    (64, None, "sm100"), (128, 30.0, "sm100"), (256, None, "xla")])
def test_which_implementation_names_the_sm100_backward_for_a_blackwell_target(
    head_dim, soft_cap, want):
  q, k, v, _ = _qkv(0, 1, 256, 4, 2, head_dim)
  with fa4_jax.gpu_target("sm100"):
    assert fa4_jax.which_implementation(q, k, v, is_causal=True, logits_soft_cap=soft_cap) == "sm100"
    assert fa4_jax.which_implementation(q, k, v, is_causal=True, logits_soft_cap=soft_cap,
                                        part="backward") == want
  with fa4_jax.gpu_target("sm90"):
    assert fa4_jax.which_implementation(q, k, v, is_causal=True, part="backward") == "sm90"
  assert fa4_jax.which_implementation(q, k, v, implementation="xla", part="backward") == "xla"
  with pytest.raises(ValueError, match="part must be 'forward' or 'backward'"):
    fa4_jax.which_implementation(q, k, v, part="gradient")


@pytest.mark.parametrize("head_dim, fused", [(64, True), (128, True), (256, False)])
def test_the_gradient_lowers_to_tcgen05_kernels_only(cross_lower, head_dim, fused):
  q, k, v, _ = _qkv(0, 1, 256, 4, 2, head_dim)
  loss = lambda q, k, v: jnp.sum(fa4_jax.attention(
      q, k, v, is_causal=True, implementation="sm100").astype(jnp.float32))
  lowered = cross_lower(jax.grad(loss, (0, 1, 2)), q, k, v, arch="sm_100")
  assert len(lowered.modules) == (3 if fused else 1)
  assert all("tcgen05.mma" in m for m in lowered.modules)
  assert not lowered.has("wgmma")


def test_interpreted_gradients_match_an_f32_reference(run_interpreted):
  """GQA, causal, per-row query and key lengths (a row whose last queries
  see nothing), an unaligned length, soft-cap: dq, dk, dv of the sm100 path
  against the f32 einsum's."""
  b, t, n, kv_heads, d, cap = 2, 200, 4, 2, 64, 20.0
  q, k, v, do = _qkv(1, b, t, n, kv_heads, d)
  q_lengths, kv_lengths = jnp.asarray([200, 150]), jnp.asarray([180, 90])
  options = dict(is_causal=True, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                 logits_soft_cap=cap)

  def grads(attend, *inputs):
    out, pull = jax.vjp(attend, *inputs)
    return pull(do.astype(out.dtype))

  got = run_interpreted(lambda q, k, v: grads(
      lambda q, k, v: fa4_jax.attention(q, k, v, implementation="sm100", **options), q, k, v),
      q, k, v)
  visible = reference.visible_mask(t, t, is_causal=True, q_lengths=tuple(map(int, q_lengths)),
                                   kv_lengths=tuple(map(int, kv_lengths)), batch=b)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = grads(lambda q, k, v: reference.einsum_attention(q, k, v, visible, soft_cap=cap)[0],
               *f32)
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, atol=GRAD_TOL * max(1.0, np.abs(w).max()), rtol=GRAD_TOL)
