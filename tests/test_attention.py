"""fa4_jax.attention matches jax.nn.dot_product_attention (XLA path, CPU).

Every supported argument combination is checked forward and backward, in
float32 and bfloat16, against `jax.nn.dot_product_attention(implementation=
"xla")` and an f32 einsum. The XLA path's blocks are shrunk to 16 so that
these small shapes walk many blocks (partial tiles, skipped tiles, tails).

Tolerances: float32 results differ from jax.nn only by summation order
(blockwise online softmax vs one softmax), ~1e-6 relative: we allow 2e-5
forward and 1e-4 for gradients. In bfloat16 both implementations round the
probabilities to bfloat16 before P.V and round the output (2^-8 relative), so
we require our error against the f32 reference to be no worse than twice
jax.nn's own, plus one bfloat16 ulp at unit scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from reference import einsum_attention, rows_seeing_keys, visible_mask

B, T, S, N, K, H = 2, 53, 53, 4, 2, 32
BF16_ULP = 2.0**-8

CASES = {
    "dense": {},
    "causal": dict(is_causal=True),
    "causal_more_keys_than_queries": dict(is_causal=True, t=40, s=72),
    "causal_more_queries_than_keys": dict(is_causal=True, t=72, s=40),
    "window_symmetric": dict(local_window_size=9),
    "window_left_right": dict(local_window_size=(12, 3)),
    "causal_with_window": dict(is_causal=True, local_window_size=(10, 0)),
    "key_value_lengths": dict(kv_lengths=[17, 53]),
    "query_lengths": dict(q_lengths=[5, 53]),
    "lengths_and_causal": dict(is_causal=True, q_lengths=[30, 53], kv_lengths=[11, 53]),
    "a_batch_with_no_keys": dict(kv_lengths=[0, 20]),
    "window_leaving_rows_without_keys": dict(local_window_size=(2, 0), t=72, s=40),
    "bias_per_head": dict(bias_shape=(1, N, T, S)),
    "bias_broadcast_over_queries": dict(bias_shape=(B, 1, 1, S)),
    "bias_rank_2": dict(bias_shape=(T, S)),
    "boolean_mask": dict(mask_shape=(B, 1, T, S)),
    "mask_bias_and_causal": dict(is_causal=True, mask_shape=(1, N, T, S), bias_shape=(B, N, T, S)),
}


def make_inputs(dtype, *, t=T, s=S, n=N, k=K, h=H, bias_shape=None, mask_shape=None,
                seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, t, n, h)), dtype)
  kk = jnp.asarray(rng.normal(size=(B, s, k, h)), dtype)
  v = jnp.asarray(rng.normal(size=(B, s, k, h)), dtype)
  bias = None if bias_shape is None else jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
  mask = None if mask_shape is None else jnp.asarray(rng.random(size=mask_shape) < 0.8)
  return q, kk, v, bias, mask


def case_arguments(case):
  kw = {}
  for name in ("is_causal", "local_window_size"):
    if name in case:
      kw[name] = case[name]
  if "q_lengths" in case:
    kw["query_seq_lengths"] = jnp.asarray(case["q_lengths"], jnp.int32)
  if "kv_lengths" in case:
    kw["key_value_seq_lengths"] = jnp.asarray(case["kv_lengths"], jnp.int32)
  return kw


def case_visibility(case, t, s, mask):
  vis = visible_mask(t, s, is_causal=case.get("is_causal", False),
                     window=case.get("local_window_size"), q_lengths=case.get("q_lengths"),
                     kv_lengths=case.get("kv_lengths"), batch=B)
  if mask is not None:
    vis = vis & np.asarray(jnp.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape),
                                            (B, N, t, s)))
  return vis


def loss_fn(attention, kwargs, cotangent, rows):
  """A scalar whose gradient exercises every output row that sees a key."""
  def loss(q, k, v, bias):
    out = attention(q, k, v, bias, kwargs["mask"], **kwargs["rest"])
    return jnp.sum(out.astype(jnp.float32) * cotangent * rows)
  return loss


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_jax_nn_forward_and_gradients(name, dtype, small_xla_blocks):
  case = CASES[name]
  t, s = case.get("t", T), case.get("s", S)
  bias_shape = case.get("bias_shape")
  if bias_shape == (T, S) or (bias_shape and bias_shape[-2:] == (T, S)):
    bias_shape = bias_shape[:-2] + (t, s)
  q, k, v, bias, mask = make_inputs(dtype, t=t, s=s, bias_shape=bias_shape,
                                    mask_shape=case.get("mask_shape"))
  rest = case_arguments(case)
  visible = case_visibility(case, t, s, mask)
  rows = rows_seeing_keys(visible, N)

  ours = fa4_jax.attention(q, k, v, bias, mask, **rest)
  theirs = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **rest)
  bias4 = None if bias is None else bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  exact, _ = einsum_attention(q, k, v, visible, bias=bias4)

  assert ours.shape == q.shape and ours.dtype == q.dtype
  # Rows that see no key are zeros (jax.nn would average all values there).
  np.testing.assert_array_equal(np.asarray(ours, np.float32) * (1 - np.asarray(rows)), 0.0)

  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=ours.shape), jnp.float32)
  kwargs = dict(mask=mask, rest=rest)
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  g_ours = jax.grad(loss_fn(fa4_jax.attention, kwargs, cotangent, rows), argnums)(q, k, v, bias)
  nn = lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation="xla", **kw)
  g_theirs = jax.grad(loss_fn(nn, kwargs, cotangent, rows), argnums)(q, k, v, bias)

  if dtype == jnp.float32:
    np.testing.assert_allclose(ours * rows, theirs * rows, atol=2e-5, rtol=2e-5)
    for a, b in zip(g_ours, g_theirs):
      np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  else:
    f32 = lambda x: np.asarray(x, np.float32)
    err_ours = np.abs(f32(ours) * rows - exact * rows).max()
    err_theirs = np.abs(f32(theirs) * rows - exact * rows).max()
    assert err_ours <= 2 * err_theirs + BF16_ULP, (err_ours, err_theirs)
    g_exact = jax.grad(loss_fn(nn, kwargs, cotangent, rows), argnums)(
        *(x.astype(jnp.float32) for x in (q, k, v)), bias)
    for a, b, ref in zip(g_ours, g_theirs, g_exact):
      scale = np.abs(f32(ref)).max()
      err_a, err_b = np.abs(f32(a) - f32(ref)).max(), np.abs(f32(b) - f32(ref)).max()
      assert err_a <= 2 * err_b + BF16_ULP * scale, (err_a, err_b, scale)


@pytest.mark.parametrize("kv_heads", [N, 2, 1], ids=["mha", "gqa", "mqa"])
def test_head_groupings_match_jax_nn(kv_heads, small_xla_blocks):
  q, k, v, _, _ = make_inputs(jnp.float32, k=kv_heads)
  ours = fa4_jax.attention(q, k, v, is_causal=True)
  theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=2e-5)
  grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), (0, 1, 2))(q, k, v)
  for a, b in zip(grad(lambda *a: fa4_jax.attention(*a, is_causal=True)),
                  grad(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True,
                                                               implementation="xla"))):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_rank_3_inputs_work_like_jax_nn():
  q, k, v, _, _ = make_inputs(jnp.float32)
  ours, lse = fa4_jax.attention(q[0], k[0], v[0], is_causal=True, return_residual=True)
  theirs, lse_nn = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                                implementation="xla", return_residual=True)
  assert ours.shape == theirs.shape and lse.shape == lse_nn.shape == (T, N)
  np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, lse_nn, atol=2e-5, rtol=2e-5)


def test_residual_is_the_log_sum_exp_and_carries_no_gradient():
  q, k, v, _, _ = make_inputs(jnp.float32)
  out, lse = fa4_jax.attention(q, k, v, return_residual=True)
  _, lse_nn = jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True)
  assert lse.shape == (B, T, N)
  np.testing.assert_allclose(lse, lse_nn, atol=2e-5, rtol=2e-5)
  g = jax.grad(lambda q: fa4_jax.attention(q, k, v, return_residual=True)[1].sum())(q)
  np.testing.assert_array_equal(g, 0.0)


def test_explicit_scale_is_used():
  q, k, v, _, _ = make_inputs(jnp.float32)
  ours = fa4_jax.attention(q, k, v, scale=0.37)
  theirs = jax.nn.dot_product_attention(q, k, v, scale=0.37, implementation="xla")
  np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=2e-5)


def test_float16_matches_the_f32_reference():
  # jax.nn itself cannot run float16 under jit on the CPU, so compare with f32.
  q, k, v, _, _ = make_inputs(jnp.float16)
  ours = fa4_jax.attention(q, k, v, is_causal=True)
  exact, _ = einsum_attention(q, k, v, visible_mask(T, S, is_causal=True, batch=B))
  assert ours.dtype == jnp.float16
  np.testing.assert_allclose(np.asarray(ours, np.float32), exact, atol=4e-3, rtol=4e-3)
