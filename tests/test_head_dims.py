"""A value head dim other than the query's and key's, and MLA's latent cache.

`value` may be `[B, S, K, Dv]` with `Dv != D` (DeepSeek's training shapes:
192 against 128); the output is `[B, T, N, Dv]`. With `value=None` and
`value_head_dim=Dv`, the values are the keys' first `Dv` features (MLA's
absorbed form: one latent head of 576 features, the first 512 the values),
in `attention` and in `paged_attention`. These tests run the XLA path (the
sm90 forward kernel's own tests: tests/test_sm90_value_head_dim.py). Every
result is checked against an f32 einsum with an explicit mask; float32
inputs, so tolerances are float32 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax.paged import gather_pages

TOL = 2e-5


def normal(rng, *shape, dtype=jnp.float32):
  return jnp.asarray(rng.normal(size=shape), dtype)


def reference(q, k, v, visible, *, scale=None, sinks=None):
  """softmax(scale q.k, masked by `visible` [B|1, N|1, T, S]) v, in float32."""
  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
  scale = scale or 1 / np.sqrt(q.shape[-1])
  s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), k) * scale
  s = jnp.where(visible, s, -jnp.inf)
  if sinks is not None:
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], s.shape[:3] + (1,))], -1)
  probs = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))[..., :k.shape[1]]
  return jnp.einsum("bnts,bsnd->btnd", probs, v)


def causal(t, s, offset=0):
  return (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + offset)[None, None]


def assert_close(got, want, tol=TOL):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, atol=tol * max(1.0, np.abs(w).max()), rtol=tol)


def weighted_sum(out):
  """A loss whose gradient weighs every output element differently."""
  return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))


# --- Unequal head dims -----------------------------------------------------------


@pytest.mark.parametrize("d, dv", [(48, 32), (32, 64), (192, 128)])
def test_value_head_dim_differs_forward_and_gradients(d, dv):
  rng = np.random.default_rng(0)
  b, t, s, n, k = 2, 70, 90, 4, 2
  q, key, v = normal(rng, b, t, n, d), normal(rng, b, s, k, d), normal(rng, b, s, k, dv)
  lengths = jnp.asarray([90, 41])
  visible = causal(t, s) & (jnp.arange(s) < lengths[:, None])[:, None, None, :]
  ours = lambda q, key, v: fa4_jax.attention(q, key, v, is_causal=True,
                                             key_value_seq_lengths=lengths)
  theirs = lambda q, key, v: reference(q, key, v, visible)
  out = ours(q, key, v)
  assert out.shape == (b, t, n, dv)
  assert_close(out, theirs(q, key, v))
  grads = jax.grad(lambda *a: weighted_sum(ours(*a)), argnums=(0, 1, 2))(q, key, v)
  assert [g.shape for g in grads] == [q.shape, key.shape, v.shape]
  assert_close(grads, jax.grad(lambda *a: weighted_sum(theirs(*a)), argnums=(0, 1, 2))(q, key, v),
               1e-4)


def test_unequal_head_dims_with_segments_sinks_bottom_right_and_a_score_mod():
  rng = np.random.default_rng(1)
  b, t, s, n, k, d, dv = 2, 24, 64, 4, 1, 48, 16
  q, key, v = normal(rng, b, t, n, d), normal(rng, b, s, k, d), normal(rng, b, s, k, dv)
  sinks = jnp.asarray([0.0, 1.0, -1.0, 0.5])
  slopes = jnp.asarray([0.1, 0.2, 0.3, 0.4])
  out = fa4_jax.attention(q, key, v, is_causal=True, causal_alignment="bottom_right",
                          sinks=sinks, score_mod=lambda sc, bb, h, i, j: sc - slopes[h] * (i - j))
  alibi = -slopes[:, None, None] * (jnp.arange(t)[:, None] - jnp.arange(s)[None, :])
  # Bottom-right: query i sits at position i + s - t; the score_mod sees i itself.
  visible = causal(t, s, s - t)
  group_k = jnp.repeat(key, n, axis=2)
  logits = jnp.einsum("btnd,bsnd->bnts", q, group_k) / np.sqrt(d) + alibi
  logits = jnp.where(visible, logits, -jnp.inf)
  with_sink = jnp.concatenate([logits, jnp.broadcast_to(sinks[:, None, None], (b, n, t, 1))], -1)
  want = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(with_sink, -1)[..., :s],
                    jnp.repeat(v, n, axis=2))
  assert_close(out, want)


def test_jvp_vmap_and_sharded_jit(host_devices):
  rng = np.random.default_rng(2)
  b, t, n, k, d, dv = 2, 40, 4, 2, 32, 16
  q, key, v = normal(rng, b, t, n, d), normal(rng, b, t, k, d), normal(rng, b, t, k, dv)
  f = lambda q, key, v: fa4_jax.attention(q, key, v, is_causal=True)
  g = lambda q, key, v: reference(q, key, v, causal(t, t))
  assert_close(jax.jvp(f, (q, key, v), (q, key, v)), jax.jvp(g, (q, key, v), (q, key, v)), 1e-4)
  stacked = jnp.stack([v, 2 * v])
  assert_close(jax.vmap(f, in_axes=(None, None, 0))(q, key, stacked),
               jnp.stack([g(q, key, v), g(q, key, 2 * v)]))
  mesh = jax.make_mesh((2, 2), ("d", "m"))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d", None, "m")))
  loss = lambda *a: weighted_sum(f(*a))
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))(put(q), put(key), put(v))
  assert_close(got, jax.value_and_grad(lambda *a: weighted_sum(g(*a)), argnums=(0, 2))(q, key, v),
               1e-4)


# --- MLA: the values are the keys' first features --------------------------------


@pytest.mark.parametrize("t", [1, 4])
def test_mla_latent_cache_contiguous(t):
  rng = np.random.default_rng(3)
  b, s, n, d, dv = 3, 80, 16, 576, 512
  q, latent = normal(rng, b, t, n, d), normal(rng, b, s, 1, d)
  lengths = jnp.asarray([80, 1 + t, 33])
  scale = 1 / np.sqrt(192)  # DeepSeek scales by the unabsorbed head dim
  out = fa4_jax.attention(q, latent, None, value_head_dim=dv, scale=scale, is_causal=True,
                          causal_alignment="bottom_right", key_value_seq_lengths=lengths)
  assert out.shape == (b, t, n, dv)
  position = lengths[:, None] - t + jnp.arange(t)[None]  # each query's place in its row
  visible = (jnp.arange(s)[None, None, :] <= position[:, :, None])[:, None]
  assert_close(out, reference(q, latent, latent[..., :dv], visible, scale=scale))


def test_mla_gradient_reaches_the_latent_through_both_roles():
  rng = np.random.default_rng(4)
  q, latent = normal(rng, 2, 8, 4, 40), normal(rng, 2, 24, 1, 40)
  ours = lambda q, c: weighted_sum(fa4_jax.attention(q, c, None, value_head_dim=24))
  theirs = lambda q, c: weighted_sum(reference(q, c, c[..., :24], True))
  assert_close(jax.grad(ours, argnums=(0, 1))(q, latent),
               jax.grad(theirs, argnums=(0, 1))(q, latent), 1e-4)


@pytest.mark.parametrize("heads, t", [(16, 1), (16, 4), (128, 2)])
def test_mla_paged_latent_cache_through_a_shuffled_table(heads, t):
  rng = np.random.default_rng(5)
  page, pages, max_pages, d, dv = 16, 20, 6, 576, 512
  q = normal(rng, 3, t, heads, d)
  key_pages = normal(rng, pages, page, 1, d)
  table = jnp.asarray(rng.permutation(pages)[:3 * max_pages].reshape(3, max_pages))
  lengths = jnp.asarray([96, t, 37])  # a full row, a row of just the new tokens, a ragged one
  out = fa4_jax.paged_attention(q, key_pages, None, table, lengths, value_head_dim=dv,
                                scale=0.1)
  assert out.shape == (3, t, heads, dv)
  assert fa4_jax.which_paged_implementation(q, key_pages, None, table, lengths,
                                            value_head_dim=dv) == "xla"
  latent = gather_pages(key_pages, table)
  position = lengths[:, None] - t + jnp.arange(t)[None]
  visible = (jnp.arange(max_pages * page)[None, None, :] <= position[:, :, None])[:, None]
  assert_close(out, reference(q, latent, latent[..., :dv], visible, scale=0.1))


def test_mla_paged_float8_latent_cache():
  rng = np.random.default_rng(6)
  q = normal(rng, 2, 1, 16, 64, dtype=jnp.bfloat16)
  key_pages = normal(rng, 8, 16, 1, 64).astype(jnp.float8_e4m3fn)
  table, lengths = jnp.asarray([[3, 1, 7], [0, 5, 2]]), jnp.asarray([40, 17])
  out = fa4_jax.paged_attention(q, key_pages, None, table, lengths, value_head_dim=48,
                                key_descale=0.5, output_dtype=jnp.float32)
  latent = gather_pages(key_pages.astype(jnp.float32) * 0.5, table)
  visible = (jnp.arange(48)[None, None, :] < lengths[:, None, None])[:, None]
  assert_close(out, reference(q, latent, latent[..., :48], visible), 5e-3)  # P in bf16


# --- What the kernels do with them, and bad input --------------------------------


def test_which_backend_serves_a_value_head_dim_of_its_own():
  q = key = jnp.ones((1, 128, 2, 192), jnp.bfloat16)
  v = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
  with fa4_jax.gpu_target("sm90"):  # the Hopper kernels, forward and backward at 192 / 128
    assert fa4_jax.which_implementation(q, key, v, is_causal=True) == "sm90"
    assert fa4_jax.which_implementation(q, key, v, part="backward") == "sm90"
    latent = jnp.ones((1, 128, 1, 576), jnp.bfloat16)  # MLA's 576 / 512: its decode kernel
    assert fa4_jax.which_implementation(latent[:, :1].repeat(16, 2), latent, None,
                                        value_head_dim=512) == "sm90_mla"
    assert fa4_jax.which_implementation(latent[:, :1].repeat(16, 2), latent, None,
                                        value_head_dim=512, part="backward") == "xla"
  with fa4_jax.gpu_target("sm100"):
    assert fa4_jax.which_implementation(q, key, v) == "xla"
  with fa4_jax.interpret_mode(), pytest.raises(ValueError, match="value head dim of 128"):
    fa4_jax.which_implementation(q, key, v, implementation="sm100")


@pytest.mark.parametrize("call, message", [
    (lambda q, k: fa4_jax.attention(q, k, None, value_head_dim=65), r"in \[1, 64\]"),
    (lambda q, k: fa4_jax.attention(q, k, None), "`value_head_dim` must be an int"),
    (lambda q, k: fa4_jax.attention(q, k, k, value_head_dim=32), "applies when `value` is None"),
    (lambda q, k: fa4_jax.attention(q, k, k[:, :5]), "`value` shape must equal `key` shape"),
    (lambda q, k: fa4_jax.attention(q.astype(jnp.float8_e4m3fn), k.astype(jnp.float8_e4m3fn),
                                    None, value_head_dim=32, value_descale=2.0),
     "leave `value_descale` out"),
    (lambda q, k: fa4_jax.paged_attention(q, k[0][None], None, jnp.zeros((2, 1), jnp.int32),
                                          jnp.ones(2, jnp.int32), value_head_dim=80),
     r"in \[1, 64\] \(the key pages' head dim\)"),
    (lambda q, k: fa4_jax.paged_attention(q, k[0][None], k[0][None, :, :, :8, None],
                                          jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32)),
     "`value_pages` must be rank 4"),
    (lambda q, k: fa4_jax.paged_attention(q, k[0][None], k[0][None, :4],
                                          jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32)),
     "`value_pages` shape must equal `key_pages` shape"),
])
def test_bad_value_head_dims_raise(call, message):
  q, k = jnp.ones((2, 3, 4, 64)), jnp.ones((2, 16, 2, 64))
  with pytest.raises(ValueError, match=message):
    call(q, k)


def test_the_ring_refuses_unequal_head_dims_and_float8(host_devices):
  mesh = jax.make_mesh((2,), ("seq",))
  q = jnp.ones((1, 64, 2, 32))
  ring = lambda *a: fa4_jax.context_parallel_attention(*a, mesh=mesh, axis_name="seq")
  with pytest.raises(ValueError, match="head dims 32 and 16"):
    ring(q, q, q[..., :16])
  with pytest.raises(ValueError, match="float8"):
    ring(*(q.astype(jnp.float8_e4m3fn),) * 3)
