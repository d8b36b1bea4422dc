"""Sinks and soft-cap on a Hopper GPU, at training sizes (skipped without one).

* The default implementation serves them with the sm90 kernels (forward and
  backward), not the XLA path.
* Forward at B2 x 8k tokens, GQA 32/8, D128, bf16 (the benchmark's shape),
  dense and causal: sampled rows of the output and lse against an f32 einsum.
* Gradients of q, k, v and the sinks at 4k tokens (GQA 16/4, D128: causal,
  dense with query/key lengths, a window) against the same f32 reference by
  `jax.grad`; gradients are bit-identical from run to run.
* Soft-cap runs the GPU's fast tanh (`tanh.approx.f32`): the tolerances below
  are the bf16 ones the plain kernels meet, at a cap that barely bends the
  logits (50) and at one that saturates them (10, logits ~4x larger).

bf16 tolerances: one bf16 rounding of P and of the output (2^-8 relative)
over sums of thousands of terms; the f32 references see the same bf16 inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from reference import einsum_attention, relative_error, visible_mask

ON_HOPPER = (jax.devices()[0].platform == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")

CAPS = {"cap 50": (50.0, 1.0), "cap 10, logits x4": (10.0, 4.0)}  # (cap, query scale)


def _inputs(seed, b, t, n, kv_heads, d, q_scale=1.0):
  keys = jax.random.split(jax.random.key(seed), 5)
  draw = lambda key, heads, shift=0.0, s=1.0: (
      shift + s * jax.random.normal(key, (b, t, heads, d))).astype(jnp.bfloat16)
  sinks = 2.0 * jax.random.normal(keys[4], (n,), jnp.float32)
  return (draw(keys[0], n, s=q_scale), draw(keys[1], kv_heads), draw(keys[2], kv_heads, 1.0),
          draw(keys[3], n), sinks)


@pytest.mark.parametrize("cap_name", list(CAPS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["dense", "causal"])
def test_forward_at_8k_tokens_matches_an_f32_einsum_on_sampled_rows(is_causal, cap_name):
  cap, q_scale = CAPS[cap_name]
  b, t, n, kv_heads, d = 2, 8192, 32, 8, 128
  q, k, v, _, sinks = _inputs(0, b, t, n, kv_heads, d, q_scale)
  options = dict(is_causal=is_causal, sinks=sinks, logits_soft_cap=cap)
  assert fa4_jax.which_implementation(q, k, v, **options) == "sm90"
  out, lse = jax.jit(lambda q, k, v, s: fa4_jax.attention(
      q, k, v, is_causal=is_causal, sinks=s, logits_soft_cap=cap, return_residual=True))(
          q, k, v, sinks)
  rows = np.sort(np.random.default_rng(1).choice(t, 256, replace=False))
  visible = np.ones((1, 1, len(rows), t), bool)
  if is_causal:
    visible = (np.arange(t)[None, :] <= rows[:, None])[None, None]
  want, want_lse = einsum_attention(q[:, rows], k, v, visible, sinks=sinks, soft_cap=cap)
  np.testing.assert_allclose(np.asarray(out[:, rows], np.float32), np.asarray(want),
                             atol=2e-2, rtol=2e-2)
  # The residual is [B, T, N] in the inputs' dtype (bf16: steps of 1/16 near 10).
  np.testing.assert_allclose(np.asarray(lse[:, rows], np.float32).transpose(0, 2, 1),
                             np.asarray(want_lse), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("cap_name", list(CAPS))
@pytest.mark.parametrize("name, options", [
    ("causal", dict(is_causal=True)),
    ("dense lengths", dict(query_seq_lengths=(4000,), key_value_seq_lengths=(3001,))),
    ("window", dict(is_causal=True, local_window_size=(300, 0))),
])
def test_gradients_at_4k_tokens_match_an_f32_einsum(name, options, cap_name):
  cap, q_scale = CAPS[cap_name]
  b, t, n, kv_heads, d = 1, 4096, 16, 4, 128
  q, k, v, dout, sinks = _inputs(2, b, t, n, kv_heads, d, q_scale)
  lengths = {key: jnp.asarray(value, jnp.int32) for key, value in options.items()
             if key.endswith("_lengths")}
  flags = {key: value for key, value in options.items() if not key.endswith("_lengths")}
  q_len = options.get("query_seq_lengths")
  kv_len = options.get("key_value_seq_lengths")
  visible = visible_mask(t, t, is_causal=flags.get("is_causal", False),
                         window=flags.get("local_window_size"), batch=b,
                         q_lengths=q_len, kv_lengths=kv_len)
  rows = np.ones((b, t, 1, 1), np.float32)
  if q_len is not None:
    rows[:, q_len[0]:] = 0.0  # rows past the query length: zeros, no gradient

  def ours(q, k, v, s):
    return fa4_jax.attention(q, k, v, sinks=s, logits_soft_cap=cap, **flags, **lengths)

  def theirs(q, k, v, s):
    return einsum_attention(q, k, v, visible, sinks=s, soft_cap=cap)[0] * rows

  assert fa4_jax.which_implementation(q, k, v, sinks=sinks, logits_soft_cap=cap, **flags,
                                      **lengths) == "sm90"
  loss = lambda attend: (lambda *a: jnp.sum(attend(*a).astype(jnp.float32)
                                            * dout.astype(jnp.float32)))
  out = jax.jit(ours)(q, k, v, sinks)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(theirs(q, k, v, sinks)),
                             atol=2e-2, rtol=2e-2)
  grad = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))
  got = grad(q, k, v, sinks)
  want = jax.jit(jax.grad(loss(theirs), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  for g, w, label in zip(got, want, ["q", "k", "v", "sinks"]):
    g, w = np.asarray(g, np.float32), np.asarray(w)
    assert np.all(np.isfinite(g)), label
    rel = relative_error(g, w)
    assert rel < 1e-2, (label, rel)
  again = grad(q, k, v, sinks)
  for g, h in zip(got, again):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(h))  # deterministic
