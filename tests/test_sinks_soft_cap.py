"""Attention sinks and logit soft-capping.

Specification:
* `sinks` ([N], one logit per query head): the output equals
  `jax.nn.dot_product_attention` on inputs extended by one key whose value is
  zero and whose logit is pinned to the sink through `bias`; the lse includes
  the sink; gradients of q, k, v and the sinks match that construction, in
  f32 and bf16, under causal masks, windows, lengths, segment ids and GQA;
  a row that sees no key gets zeros; large sinks (+-30) and large logits
  give no inf or nan.
* `logits_soft_cap`: the output and gradients equal an f32 einsum reference
  of `cap * tanh(logits / cap)` (logits scaled and biased) with the mask.
* The kernels: the sm90 and sm100 forwards start their softmax from the
  sinks and soft-cap in the kernel; a backend without them gets the sinks
  added to its output and lse, and a kernel without soft-cap leaves such
  calls to the XLA path under `implementation=None` and says why it cannot
  when asked for by name.
* The fixed softmax max of soft-capped logits (`scores.fixed_max_is_exact`):
  where it holds and where not, and how the rows start from a sink.
* Bad input: a ValueError naming the argument.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import scores
from reference import jax_nn_with_sinks, packed_segment_ids, visible_mask

TOLERANCE = {"float32": 3e-5, "bfloat16": 2e-2}


def _inputs(seed, b, t, s, n, kv_heads, h, dtype, logit_scale=1.0):
  rng = np.random.default_rng(seed)
  draw = lambda shape, shift=0.0, scale=1.0: jnp.asarray(shift + scale * rng.normal(size=shape),
                                                         dtype)
  return (draw((b, t, n, h), scale=logit_scale), draw((b, s, kv_heads, h)),
          draw((b, s, kv_heads, h), 1.0), draw((b, t, n, h)))


def _check(ours, theirs, q, k, v, sinks, dout, tol):
  out = jax.jit(ours)(q, k, v, sinks)
  want = theirs(q, k, v, sinks)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=tol, rtol=tol)
  loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dout.astype(jnp.float32)))
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  got = jax.jit(jax.grad(loss(ours), argnums=argnums))(q, k, v, sinks)
  exp = jax.grad(loss(theirs), argnums=argnums)(q, k, v, sinks)
  for g, w in zip(got, exp):
    g = np.asarray(g, np.float32)
    assert np.all(np.isfinite(g))
    bound = max(1.0, float(jnp.abs(w).max()))
    np.testing.assert_allclose(g, np.asarray(w), atol=tol * bound, rtol=tol)


@pytest.mark.parametrize("name, dtype, options", [
    ("dense", "float32", dict()),
    ("causal gqa", "float32", dict(is_causal=True)),
    ("causal", "bfloat16", dict(is_causal=True)),
    ("window lengths", "float32", dict(window=(5, 3), q_lengths=(30, 17), kv_lengths=(40, 9))),
    ("segments", "float32", dict(is_causal=True, segments=True)),
])
def test_sinks_equal_an_extra_zero_valued_key_with_the_sink_as_its_logit(small_xla_blocks, name,
                                                                          dtype, options):
  b, t, s, n, kv_heads, h = 2, 40, 40, 4, 2, 16
  q, k, v, dout = _inputs(len(name), b, t, s, n, kv_heads, h, dtype)
  sinks = jnp.asarray([-1.0, 0.5, 2.0, 30.0], dtype)  # 30: the sink takes nearly everything
  ids = None
  if options.get("segments"):
    ids = np.stack([packed_segment_ids([7, 20, 13], t), packed_segment_ids([1, 39], t)])
  q_lengths, kv_lengths = options.get("q_lengths"), options.get("kv_lengths")
  visible = visible_mask(t, s, is_causal=options.get("is_causal", False),
                         window=options.get("window"), q_lengths=q_lengths,
                         kv_lengths=kv_lengths, batch=b, q_segment_ids=ids, kv_segment_ids=ids)
  rows = np.ones((b, t), bool) if q_lengths is None else np.arange(t)[None] < np.asarray(q_lengths)[:, None]
  as_i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)

  def ours(q, k, v, sinks):
    return fa4_jax.attention(q, k, v, is_causal=options.get("is_causal", False),
                             local_window_size=options.get("window"),
                             query_seq_lengths=as_i32(q_lengths),
                             key_value_seq_lengths=as_i32(kv_lengths),
                             query_segment_ids=as_i32(ids), key_value_segment_ids=as_i32(ids),
                             sinks=sinks, implementation="xla")

  def theirs(q, k, v, sinks):
    out = jax_nn_with_sinks(q, k, v, sinks, visible, 1 / np.sqrt(h))
    return out * jnp.asarray(rows)[:, :, None, None]  # rows past the length: zeros

  _check(ours, theirs, q, k, v, sinks, dout, TOLERANCE[dtype])


def test_the_residual_includes_the_sink_and_rows_without_keys_get_zeros_and_the_sink():
  q, k, v, _ = _inputs(1, 1, 8, 8, 2, 2, 8, "float32")
  sinks = jnp.asarray([0.25, -3.0], jnp.float32)
  kv_lengths = jnp.asarray([0], jnp.int32)  # no row sees a key
  out, lse = fa4_jax.attention(q, k, v, sinks=sinks, key_value_seq_lengths=kv_lengths,
                               return_residual=True)
  assert np.all(np.asarray(out) == 0)
  np.testing.assert_allclose(np.asarray(lse), np.broadcast_to([0.25, -3.0], (1, 8, 2)))
  out, lse = fa4_jax.attention(q, k, v, sinks=sinks, return_residual=True)
  _, plain = fa4_jax.attention(q, k, v, return_residual=True)
  np.testing.assert_allclose(np.asarray(lse), np.logaddexp(np.asarray(plain), [0.25, -3.0]),
                             rtol=1e-6)


def test_large_sinks_and_large_logits_stay_finite():
  q, k, v, dout = _inputs(2, 1, 16, 16, 2, 1, 8, "float32", logit_scale=300.0)
  for value in (-30.0, 30.0, 1e4):
    sinks = jnp.full((2,), value, jnp.float32)
    f = lambda q, sinks: fa4_jax.attention(q, k, v, is_causal=True, sinks=sinks)
    out = f(q, sinks)
    grads = jax.grad(lambda q, sinks: jnp.sum(f(q, sinks) * dout), argnums=(0, 1))(q, sinks)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in (out, *grads)), value


def _soft_cap_reference(q, k, v, visible, cap, scale, bias=None):
  f32 = lambda x: x.astype(jnp.float32)
  n, kv_heads = q.shape[2], k.shape[2]
  kf = jnp.repeat(f32(k), n // kv_heads, axis=2)
  vf = jnp.repeat(f32(v), n // kv_heads, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", f32(q), kf, precision="highest") * scale
  if bias is not None:
    logits = logits + bias
  logits = cap * jnp.tanh(logits / cap)
  logits = jnp.where(visible, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", probs, vf, precision="highest")


@pytest.mark.parametrize("name, dtype, options", [
    ("dense", "float32", dict()),
    ("causal gqa", "float32", dict(is_causal=True)),
    ("causal", "bfloat16", dict(is_causal=True)),
    ("bias window", "float32", dict(window=(6, 2), bias=True)),
])
def test_soft_cap_equals_cap_times_tanh_of_the_scaled_logits(small_xla_blocks, name, dtype,
                                                             options):
  b, t, n, kv_heads, h, cap = 2, 40, 4, 2, 16, 5.0
  q, k, v, dout = _inputs(len(name) + 10, b, t, t, n, kv_heads, h, dtype, logit_scale=4.0)
  visible = visible_mask(t, t, is_causal=options.get("is_causal", False),
                         window=options.get("window"), batch=b)
  bias = None
  if options.get("bias"):
    bias = jnp.asarray(np.random.default_rng(5).normal(size=(1, n, t, t)), jnp.float32)

  ours = lambda q, k, v, _: fa4_jax.attention(
      q, k, v, bias, is_causal=options.get("is_causal", False),
      local_window_size=options.get("window"), logits_soft_cap=cap)
  theirs = lambda q, k, v, _: _soft_cap_reference(q, k, v, visible, cap, 1 / np.sqrt(h), bias)
  _check(ours, theirs, q, k, v, None, dout, TOLERANCE[dtype])


def test_sinks_and_soft_cap_combine():
  q, k, v, dout = _inputs(20, 1, 24, 24, 2, 2, 8, "float32", logit_scale=5.0)
  sinks = jnp.asarray([1.0, -2.0], jnp.float32)
  visible = visible_mask(24, 24, is_causal=True)
  cap, scale = 3.0, 1 / np.sqrt(8)

  def theirs(q, k, v, sinks):
    # The sink is one more logit (not capped) beside the capped ones.
    f32 = lambda x: x.astype(jnp.float32)
    logits = cap * jnp.tanh(jnp.einsum("btnh,bsnh->bnts", f32(q), f32(k),
                                       precision="highest") * scale / cap)
    logits = jnp.where(visible, logits, -jnp.inf)
    logits = jnp.concatenate([logits, jnp.broadcast_to(sinks[None, :, None, None],
                                                       logits.shape[:3] + (1,))], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", probs, f32(v), precision="highest")

  ours = lambda q, k, v, sinks: fa4_jax.attention(q, k, v, is_causal=True, sinks=sinks,
                                                  logits_soft_cap=cap)
  _check(ours, theirs, q, k, v, sinks, dout, 3e-5)


def test_the_sm90_forward_takes_sinks_and_soft_cap_in_the_kernel(run_interpreted):
  """The kernel starts its softmax from the sinks and soft-caps the logits;
  its lse (with the sink) feeds the XLA backward, which soft-cap still
  needs: output, lse and gradients equal the XLA path's."""
  q, k, v, dout = _inputs(21, 1, 64, 64, 2, 2, 64, "bfloat16", logit_scale=3.0)
  sinks = jnp.asarray([0.5, 3.0], jnp.float32)
  options = dict(is_causal=True, logits_soft_cap=2.0)

  def attend_and_grad(implementation):
    def attend(q, k, v, s):
      return fa4_jax.attention(q, k, v, sinks=s, return_residual=True,
                               implementation=implementation, **options)

    (out, lse), vjp = jax.vjp(attend, q, k, v, sinks)
    return out, lse, vjp((dout, jnp.zeros_like(lse)))

  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, sinks=sinks, implementation="sm90",
                                        **options) == "sm90"
  got = run_interpreted(attend_and_grad, "sm90")
  want = attend_and_grad("xla")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    bound = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, atol=2e-2 * bound, rtol=2e-2)


def test_a_kernel_without_soft_cap_leaves_it_to_the_xla_path(monkeypatch):
  """A kernel module that does not list "score_function" in its FEATURES
  (it would not form its logits through the call's score function) is not
  picked for a soft-capped call, and asking for it by name says why."""
  from fa4_jax.kernels import sm90_forward

  monkeypatch.setattr(sm90_forward, "FEATURES", frozenset({"sinks"}))
  q, k, v, _ = _inputs(21, 1, 64, 64, 2, 2, 64, "bfloat16")
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, logits_soft_cap=2.0) == "xla"
    with pytest.raises(ValueError, match="does not support `logits_soft_cap` yet"):
      fa4_jax.which_implementation(q, k, v, logits_soft_cap=2.0, implementation="sm90")


def test_the_sm100_forward_takes_sinks_and_soft_cap_in_the_kernel(run_interpreted):
  q, k, v, _ = _inputs(24, 1, 64, 64, 2, 2, 64, "bfloat16", logit_scale=3.0)
  sinks = jnp.asarray([0.5, 3.0], jnp.float32)
  options = dict(is_causal=True, sinks=sinks, logits_soft_cap=2.0)
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, **options, implementation="sm100") == "sm100"
  got = run_interpreted(lambda q, k, v, s: fa4_jax.attention(
      q, k, v, **dict(options, sinks=s), implementation="sm100"), q, k, v, sinks)
  want = fa4_jax.attention(q, k, v, **options, implementation="xla")
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_a_fixed_softmax_max_is_exact_for_bf16_caps_within_the_f32_range():
  """Soft-capped logits bound P = exp2(c t - m) by 2^(cap log2 e): the
  kernels may skip the running max where that, times the keys, stays far
  inside f32 and P's dtype has f32's exponents (bf16, not fp16)."""
  assert scores.fixed_max_is_exact(jnp.bfloat16, 50.0, 8192)  # Gemma 2
  assert scores.fixed_max_is_exact(jnp.bfloat16, 50.0, 2 ** 23)
  assert not scores.fixed_max_is_exact(jnp.bfloat16, 50.0, 2 ** 24)
  assert not scores.fixed_max_is_exact(jnp.float16, 50.0, 8192)  # 65504
  assert not scores.fixed_max_is_exact(jnp.float16, 2.0, 128)
  assert not scores.fixed_max_is_exact(jnp.bfloat16, 1000.0, 8192)
  assert not scores.fixed_max_is_exact(jnp.bfloat16, None, 8192)
  # Where it holds, the largest row sum and O (|v| <= 2^31) stay finite in
  # f32 and the smallest P is a normal number.
  cap, keys = 60.0, 256
  assert scores.fixed_max_is_exact(jnp.bfloat16, cap, keys)
  c = scores.softmax_scale(1.0, cap)
  largest_p = np.exp2(np.float32(c))
  assert np.isfinite(np.float32(largest_p * keys * 2.0 ** 31))
  assert np.exp2(np.float32(-c)) >= np.finfo(np.float32).tiny
  assert np.isfinite(np.asarray(largest_p, jnp.bfloat16).astype(np.float32))


def test_the_fixed_max_rows_start_from_the_sink_below_one():
  """m0 = max(sink, 0) in log2 units and l = exp2(sink - m0): the sink's
  term never exceeds 1, and lse = m0 + log2(l) is the sink."""
  for sink in (-30.0, -2.0, 0.0, 1.0, 45.0):
    m, l = scores.initial_row_stats(4, sink=jnp.float32(sink), fixed_max=True)
    np.testing.assert_allclose(np.asarray(m), max(sink * scores.LOG2_E, 0.0), rtol=1e-7)
    assert np.all(np.asarray(l) <= 1.0)
    _, lse = scores.finish_rows(m, l)
    np.testing.assert_allclose(np.asarray(lse), sink, rtol=1e-6, atol=1e-6)
  m, l = scores.initial_row_stats(4, fixed_max=True)
  assert np.all(np.asarray(m) == 0.0) and np.all(np.asarray(l) == 0.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sinks=jnp.zeros((3,))), r"`sinks` shape must be \(query heads,\) = \(4,\)"),
    (dict(sinks=jnp.zeros((2,))), r"`sinks` shape must be \(query heads,\) = \(4,\)"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), "`sinks` must be a floating-point array"),
    (dict(logits_soft_cap=0.0), "`logits_soft_cap` must be positive"),
    (dict(logits_soft_cap=-1.0), "`logits_soft_cap` must be positive"),
    (dict(logits_soft_cap="big"), "`logits_soft_cap` must be a positive number"),
])
def test_bad_sinks_and_soft_caps_raise_naming_the_argument(kwargs, message):
  q = jnp.ones((1, 8, 4, 8))
  k = jnp.ones((1, 8, 2, 8))
  with pytest.raises(ValueError, match=message):
    fa4_jax.attention(q, k, k, **kwargs)


def test_a_traced_soft_cap_is_refused():
  q = jnp.ones((1, 8, 2, 8))
  with pytest.raises(ValueError, match="not a traced value"):
    jax.jit(lambda cap: fa4_jax.attention(q, q, q, logits_soft_cap=cap))(2.0)


def test_flax_attention_fn_passes_sinks_and_soft_cap_through():
  import fa4_jax.flax

  q, k, v, _ = _inputs(22, 2, 16, 16, 2, 2, 8, "float32")
  sinks = jnp.asarray([0.5, -1.0], jnp.float32)
  capped = fa4_jax.flax.make_attention_fn(is_causal=True, logits_soft_cap=4.0)
  got = capped(q, k, v, sinks=sinks)
  want = fa4_jax.attention(q, k, v, is_causal=True, sinks=sinks, logits_soft_cap=4.0)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_batch_and_head_sharded_jit_with_sinks_gathers_no_inputs(host_devices):
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((2, 2), ("data", "model"))
  q, k, v, dout = _inputs(23, 4, 16, 16, 4, 2, 8, "float32")
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
  attend = lambda q, k, v, s: fa4_jax.attention(q, k, v, is_causal=True, sinks=s,
                                                logits_soft_cap=3.0)

  def fn(q, k, v, s, dout):
    out, vjp = jax.vjp(attend, q, k, v, s)
    return out, vjp(dout)

  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
  args = [put(q), put(k), put(v), jax.device_put(sinks, NamedSharding(mesh, P("model"))),
          put(dout)]
  compiled = jax.jit(fn).lower(*args).compile()
  out, grads = compiled(*args)
  want_out, want_vjp = jax.vjp(attend, q, k, v, sinks)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5)
  for g, w in zip(grads, want_vjp(dout)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
  assert "all-gather" not in compiled.as_text()
