"""Packed sequences: `query_segment_ids` / `key_value_segment_ids`.

Specification:
* a query sees a key only when their ids are equal, on top of causal masks,
  windows, lengths and GQA: output and gradients equal
  `jax.nn.dot_product_attention(implementation="xla")` given the equivalent
  boolean mask, in f32 and bf16, for random packings, interleaved
  (non-contiguous) ids, one-token segments and cross-attention (T != S) with
  different layouts;
* a query whose segment has no key gets zeros and an lse of -inf, and its
  gradients are zero and finite;
* the tile ranges every backend walks (`scores.segment_tile_ranges`) cover
  every block a tile's ids meet, mark full only blocks where every pair
  shares an id, and skip the rest: for a known packing the visited blocks
  are counted;
* the ids work under jit, vmap, grad, batch-sharded jit (no all-gather of
  q/k/v), through `fa4_jax.flax` and `context_parallel_attention`;
* bad ids raise a ValueError naming the argument.

The kernels' own segment tests (interpreter with race detection,
cross-lowering) live in the kernel test files.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import scores
from fa4_jax.scores import MaskSpec
from reference import (einsum_attention, packed_segment_ids, random_packing, relative_error,
                       rows_seeing_keys, visible_mask)

TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}


def _inputs(seed, b, t, s, n, kv_heads, h, dtype):
  rng = np.random.default_rng(seed)
  draw = lambda shape, shift=0.0: jnp.asarray(shift + rng.normal(size=shape), dtype)
  return (draw((b, t, n, h)), draw((b, s, kv_heads, h)), draw((b, s, kv_heads, h), 1.0),
          draw((b, t, n, h)))


def _check_against_jax_nn(q, k, v, dout, q_ids, kv_ids, *, is_causal=False, window=None,
                          q_lengths=None, kv_lengths=None):
  """fa4_jax.attention (XLA path) with segment ids == jax.nn with the mask,
  forward and gradients, on the rows that see a key; the others are zeros."""
  b, t, n, _ = q.shape
  s = k.shape[1]
  visible = visible_mask(t, s, is_causal=is_causal, window=window, q_lengths=q_lengths,
                         kv_lengths=kv_lengths, batch=b, q_segment_ids=q_ids,
                         kv_segment_ids=kv_ids)
  seen = rows_seeing_keys(visible, n)  # [B, T, N, 1]
  as_ids = lambda x: jnp.asarray(x, jnp.int32)
  lengths = lambda x: None if x is None else jnp.asarray(x, jnp.int32)

  def ours(q, k, v):
    return fa4_jax.attention(q, k, v, is_causal=is_causal, local_window_size=window,
                             query_seq_lengths=lengths(q_lengths),
                             key_value_seq_lengths=lengths(kv_lengths),
                             query_segment_ids=as_ids(q_ids),
                             key_value_segment_ids=as_ids(kv_ids), implementation="xla")

  def theirs(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=jnp.asarray(visible),
                                        implementation="xla")

  def loss(attend):
    return lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * seen * dout)

  tol = TOLERANCE[q.dtype.name]
  out = jax.jit(ours)(q, k, v)
  np.testing.assert_allclose(np.asarray(out, np.float32) * seen,
                             np.asarray(theirs(q, k, v)) * seen, atol=tol, rtol=tol)
  assert np.all(np.asarray(out, np.float32)[np.broadcast_to(seen == 0, out.shape)] == 0)
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    scale = max(1.0, float(jnp.abs(w).max()))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=tol * scale,
                               rtol=tol)


def _random_ids(seed, b, length, max_documents):
  rng = np.random.default_rng(seed)
  return np.stack([random_packing(rng, length, max_documents) for _ in range(b)])


@pytest.mark.parametrize("name, dtype, options", [
    ("dense", "float32", dict()),
    ("causal", "float32", dict(is_causal=True)),
    ("causal", "bfloat16", dict(is_causal=True)),
    ("causal window", "float32", dict(is_causal=True, window=(9, 0))),
    ("window", "bfloat16", dict(window=(5, 7))),
    ("lengths", "float32", dict(q_lengths=(70, 33), kv_lengths=(61, 80))),
])
def test_random_packings_match_jax_nn_with_the_equivalent_mask(small_xla_blocks, dtype, name,
                                                               options):
  q, k, v, dout = _inputs(0, 2, 80, 80, 4, 2, 16, dtype)
  ids = _random_ids(len(name), 2, 80, 20)
  _check_against_jax_nn(q, k, v, dout, ids, ids, **options)


def test_many_documents_of_every_length_from_one_token_to_the_whole_row(small_xla_blocks):
  q, k, v, dout = _inputs(1, 3, 64, 64, 2, 1, 8, "float32")
  ids = np.stack([packed_segment_ids([1, 1, 5, 17, 40], 64),  # one-token segments
                  packed_segment_ids([64], 64),  # one document
                  np.arange(64, dtype=np.int32)])  # every token its own segment
  _check_against_jax_nn(q, k, v, dout, ids, ids, is_causal=True)


def test_interleaved_ids_are_masked_element_by_element(small_xla_blocks):
  q, k, v, dout = _inputs(2, 2, 48, 48, 2, 2, 8, "float32")
  ids = np.stack([np.arange(48) % 3, (np.arange(48) // 5) % 2]).astype(np.int32)
  _check_against_jax_nn(q, k, v, dout, ids, ids)
  _check_against_jax_nn(q, k, v, dout, ids, ids, is_causal=True)


def test_any_integer_values_work_not_only_zero_to_n(small_xla_blocks):
  q, k, v, dout = _inputs(3, 1, 40, 40, 2, 2, 8, "float32")
  ids = np.where(np.arange(40) < 17, -7, 2**30).astype(np.int32)[None]
  _check_against_jax_nn(q, k, v, dout, ids, ids, is_causal=True)


def test_cross_attention_with_different_layouts_and_unseen_segments(small_xla_blocks):
  # Queries of segment 3 have no key: zeros, lse -inf, zero finite gradients.
  q, k, v, dout = _inputs(4, 2, 40, 72, 4, 1, 16, "float32")
  q_ids = np.stack([packed_segment_ids([10, 20, 5], 40), packed_segment_ids([40], 40)])
  kv_ids = np.stack([packed_segment_ids([30, 2, 40], 72), packed_segment_ids([72], 72) + 1])
  _check_against_jax_nn(q, k, v, dout, q_ids, kv_ids)


def test_a_query_segment_without_keys_gets_zeros_an_lse_of_minus_inf_and_zero_gradients():
  q, k, v, dout = _inputs(5, 1, 16, 16, 2, 2, 8, "float32")
  q_ids = jnp.asarray([[0] * 8 + [1] * 8], jnp.int32)
  kv_ids = jnp.zeros((1, 16), jnp.int32)  # no key of segment 1
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, query_segment_ids=q_ids,
                                             key_value_segment_ids=kv_ids,
                                             return_residual=True)
  out, lse = attend(q, k, v)
  assert np.all(np.asarray(out)[:, 8:] == 0)
  assert np.all(np.asarray(lse)[:, 8:] == -np.inf)
  assert np.all(np.isfinite(np.asarray(lse)[:, :8]))
  dq, dk, dv = jax.grad(lambda *a: jnp.sum(attend(*a)[0] * dout), argnums=(0, 1, 2))(q, k, v)
  assert np.all(np.asarray(dq)[:, 8:] == 0)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in (dq, dk, dv))


def test_rank_3_inputs_take_rank_1_ids():
  q, k, v, _ = _inputs(6, 1, 24, 24, 2, 2, 8, "float32")
  ids = packed_segment_ids([10, 14], 24)
  out3 = fa4_jax.attention(q[0], k[0], v[0], query_segment_ids=ids, key_value_segment_ids=ids)
  out4 = fa4_jax.attention(q, k, v, query_segment_ids=ids[None], key_value_segment_ids=ids[None])
  np.testing.assert_array_equal(np.asarray(out3), np.asarray(out4[0]))


# --- Tile skipping -----------------------------------------------------------


def test_tile_ranges_visit_only_the_blocks_of_a_tiles_own_documents():
  # Four documents of 64 tokens in a row of 256, tiles of 32: each query tile
  # meets the two key blocks of its document, both full.
  ids = jnp.asarray(packed_segment_ids([64] * 4, 256))[None]
  r = scores.segment_tile_ranges(ids, ids, 32, 32)
  np.testing.assert_array_equal(r.lo[0], [0, 0, 2, 2, 4, 4, 6, 6])
  np.testing.assert_array_equal(r.hi[0], [2, 2, 4, 4, 6, 6, 8, 8])
  np.testing.assert_array_equal(r.full_lo[0], r.lo[0])
  np.testing.assert_array_equal(r.full_hi[0], r.hi[0])
  # With a causal mask on top, tile t walks its document's blocks up to the
  # diagonal: 1, 2, 1, 2, ... blocks instead of 1, 2, 3, ..., 8.
  visited, masked = [], []
  for tile in range(8):
    band = scores.kv_tile_ranges(MaskSpec(right=0), tile * 32, tile * 32 + 32, 256, 256, 32)
    own = scores.TileRanges(*(x[0, tile] for x in (r.lo, r.hi, r.full_lo, r.full_hi)))
    both = band.intersect(own)
    visited.append(int(both.hi - both.lo))
    masked.append(int((both.hi - both.lo) - (both.full_hi - both.full_lo)))
  assert visited == [1, 2] * 4
  assert masked == [1] * 8  # only the diagonal block needs the element mask


def test_a_boundary_inside_a_tile_makes_only_that_tiles_blocks_masked():
  ids = jnp.asarray(packed_segment_ids([40, 88], 128))[None]  # boundary inside tile 1
  r = scores.segment_tile_ranges(ids, ids, 32, 32)
  np.testing.assert_array_equal(r.lo[0], [0, 0, 1, 1])
  np.testing.assert_array_equal(r.hi[0], [2, 4, 4, 4])
  full = np.asarray(r.full_hi[0] - r.full_lo[0])
  np.testing.assert_array_equal(full, [1, 0, 2, 2])


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_tile_ranges_cover_every_meeting_block_and_full_ones_share_one_id(sorted_ids):
  rng = np.random.default_rng(7)
  for _ in range(20):
    t, s = (int(x) for x in rng.integers(1, 90, 2))
    bq, bk = (int(x) for x in rng.choice([8, 16, 24], 2))
    draw = lambda n: (np.sort(rng.integers(0, 6, (2, n)), 1) if sorted_ids
                      else rng.integers(0, 4, (2, n)))
    q_ids, kv_ids = draw(t), draw(s)
    r = scores.segment_tile_ranges(jnp.asarray(q_ids), jnp.asarray(kv_ids), bq, bk)
    lo, hi, full_lo, full_hi = (np.asarray(x) for x in (r.lo, r.hi, r.full_lo, r.full_hi))
    for b in range(2):
      for tile in range(-(-t // bq)):
        rows = q_ids[b, tile * bq:(tile + 1) * bq]
        for block in range(-(-s // bk)):
          same = rows[:, None] == kv_ids[b, block * bk:(block + 1) * bk][None, :]
          inside = lo[b, tile] <= block < hi[b, tile]
          full = full_lo[b, tile] <= block < full_hi[b, tile]
          assert inside or not same.any()
          assert not full or (inside and same.all())


# --- Transformations, sharding, Flax, context parallelism ----------------------


def test_segment_ids_are_traced_under_jit_and_batched_under_vmap():
  q, k, v, _ = _inputs(8, 3, 24, 24, 2, 2, 8, "float32")
  ids = jnp.asarray(_random_ids(8, 3, 24, 5))
  attend = lambda q, k, v, ids: fa4_jax.attention(q, k, v, is_causal=True,
                                                  query_segment_ids=ids,
                                                  key_value_segment_ids=ids)
  eager = attend(q, k, v, ids)
  jitted = jax.jit(attend)
  np.testing.assert_allclose(np.asarray(jitted(q, k, v, ids)), np.asarray(eager), atol=1e-6)
  # Other ids, same compiled function: no ids were baked into it.
  other = jnp.zeros_like(ids)
  np.testing.assert_allclose(np.asarray(jitted(q, k, v, other)),
                             np.asarray(fa4_jax.attention(q, k, v, is_causal=True)), atol=1e-6)
  mapped = jax.vmap(attend)(q[:, None], k[:, None], v[:, None], ids[:, None])
  np.testing.assert_allclose(np.asarray(mapped[:, 0]), np.asarray(eager), atol=1e-6)


def test_batch_sharded_jit_keeps_ids_and_qkv_sharded(host_devices):
  mesh = jax.make_mesh((4,), ("data",))
  q, k, v, dout = _inputs(9, 4, 32, 32, 2, 2, 8, "float32")
  ids = jnp.asarray(_random_ids(9, 4, 32, 6))
  attend = lambda q, k, v, ids: fa4_jax.attention(q, k, v, is_causal=True,
                                                  query_segment_ids=ids,
                                                  key_value_segment_ids=ids)

  def fn(q, k, v, ids, dout):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, ids), q, k, v)
    return out, vjp(dout)

  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
  args = [put(x) for x in (q, k, v, ids, dout)]
  compiled = jax.jit(fn).lower(*args).compile()
  out, grads = compiled(*args)
  want_out, want_vjp = jax.vjp(lambda q, k, v: attend(q, k, v, ids), q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5)
  for g, w in zip(grads, want_vjp(dout)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
  assert "all-gather" not in compiled.as_text()


def test_flax_attention_fn_takes_ids_as_arguments_or_from_a_block():
  from flax import nnx
  import fa4_jax.flax

  x = jnp.asarray(np.random.default_rng(10).normal(size=(2, 3, 24, 16)), jnp.float32)
  ids = jnp.asarray(_random_ids(10, 6, 24, 4)).reshape(2, 3, 24)
  layer = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
                                 rngs=nnx.Rngs(0), attention_fn=fa4_jax.flax.attention_fn)
  reference = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
                                     rngs=nnx.Rngs(0))
  # Flax's own attention with the equivalent mask [batch..., 1, q, kv].
  mask = (ids[..., :, None] == ids[..., None, :])[..., None, :, :]
  want = reference(x, mask=mask & nnx.make_causal_mask(x[..., 0]).astype(bool))

  @nnx.jit
  def packed(layer, x, ids):
    with fa4_jax.flax.segment_ids(ids, ids):
      return layer(x, is_causal=True)

  np.testing.assert_allclose(np.asarray(packed(layer, x, ids)), np.asarray(want), atol=2e-5)
  q = jnp.asarray(np.random.default_rng(11).normal(size=(2, 3, 24, 2, 8)), jnp.float32)
  direct = fa4_jax.flax.attention_fn(q, q, q, query_segment_ids=ids, key_value_segment_ids=ids)
  flat = fa4_jax.attention(q.reshape(6, 24, 2, 8), q.reshape(6, 24, 2, 8), q.reshape(6, 24, 2, 8),
                           query_segment_ids=ids.reshape(6, 24),
                           key_value_segment_ids=ids.reshape(6, 24))
  np.testing.assert_allclose(np.asarray(direct).reshape(flat.shape), np.asarray(flat), atol=1e-6)


def test_flax_segment_block_refuses_ids_fixed_outside_the_trace():
  import fa4_jax.flax

  q = jnp.ones((1, 8, 2, 8))
  ids = jnp.zeros((1, 8), jnp.int32)
  with fa4_jax.flax.segment_ids(ids, ids):
    with pytest.raises(ValueError, match="inside the jitted function"):
      jax.jit(lambda q: fa4_jax.flax.attention_fn(q, q, q))(q)


def _jitted_vjp(f, dout, *args):
  """f(*args) and its vjp of `dout`, in one jitted call (op by op, the ring's
  shard_maps took a minute on two CPU cores)."""
  def forward_and_vjp(dout, *args):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(dout)
  return jax.jit(forward_and_vjp)(dout, *args)


def test_context_parallel_attention_masks_each_ring_step_with_the_held_blocks_ids(host_devices):
  mesh = jax.make_mesh((2,), ("seq",))
  q, k, v, dout = _inputs(12, 1, 16, 16, 2, 1, 8, "float32")
  ids = jnp.asarray(packed_segment_ids([3, 6, 1, 4], 16))[None]
  balance = lambda x: fa4_jax.load_balance(x, 2)
  ring = lambda q, k, v, ids: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True, query_segment_ids=ids,
      key_value_segment_ids=ids)
  whole = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                            key_value_segment_ids=ids)
  put = lambda x: jax.device_put(balance(x), NamedSharding(mesh, P(None, "seq")))
  out, grads = _jitted_vjp(ring, put(dout), put(q), put(k), put(v), put(ids))
  want, want_grads = _jitted_vjp(whole, dout, q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(balance(want)), atol=3e-5)
  for g, w in zip(grads[:3], want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(balance(w)), atol=3e-5)


def test_the_ring_hands_the_ids_to_the_sm90_kernels_forward_and_backward(host_devices,
                                                                         run_interpreted):
  """The test above takes the XLA path (two devices: each step masks with the
  held block's ids, not its own); here every call of the ring is the sm90
  forward or backward kernel, in the interpreter with race detection, which
  keeps one GPU's state: one device, holding both load-balanced chunks.
  Documents cross the chunk boundary (at 128), one is a single token."""
  mesh = jax.make_mesh((1,), ("seq",))
  q, k, v, dout = _inputs(13, 1, 256, 256, 2, 1, 64, "bfloat16")
  ids = jnp.asarray(packed_segment_ids([90, 77, 1, 88], 256))[None]
  ring = lambda q, k, v, ids: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True, query_segment_ids=ids,
      key_value_segment_ids=ids, implementation="sm90")
  visible = visible_mask(256, 256, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
  reference = lambda q, k, v: einsum_attention(q, k, v, visible)[0]
  balance = lambda x: fa4_jax.load_balance(x, 1)
  put = lambda x: jax.device_put(balance(x), NamedSharding(mesh, P(None, "seq")))
  out, grads = run_interpreted(lambda *a: _jitted_vjp(ring, *a),
                               put(dout), put(q), put(k), put(v), put(ids))
  want, want_grads = _jitted_vjp(reference, dout.astype(jnp.float32), q, k, v)
  # bf16: one rounding of P and of the output against an f32 einsum of the
  # same bf16 inputs; gradients as relative errors over the whole array.
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(balance(want)),
                             atol=2e-2, rtol=2e-2)
  for g, w in zip(grads[:3], want_grads):
    assert relative_error(g, balance(w)) < 1e-2


# --- Bad input -------------------------------------------------------------------


@pytest.mark.parametrize("q_ids, kv_ids, message", [
    (np.zeros((2, 16), np.int32), None, "`query_segment_ids` was given without `key_value_segment_ids`"),
    (None, np.zeros((2, 24), np.int32), "`key_value_segment_ids` was given without `query_segment_ids`"),
    (np.zeros((2, 16), np.float32), np.zeros((2, 24), np.int32), "`query_segment_ids` must be an integer array"),
    (np.zeros((2, 16), np.int32), np.zeros((2, 24), bool), "`key_value_segment_ids` must be an integer array"),
    (np.zeros((2, 24), np.int32), np.zeros((2, 24), np.int32), r"`query_segment_ids` shape must be \(batch, seq\) = \(2, 16\)"),
    (np.zeros((1, 16), np.int32), np.zeros((1, 24), np.int32), r"`query_segment_ids` shape must be \(batch, seq\) = \(2, 16\)"),
    (np.zeros((2, 16), np.int32), np.zeros((24,), np.int32), r"`key_value_segment_ids` shape must be \(batch, seq\) = \(2, 24\)"),
])
def test_bad_segment_ids_raise_a_value_error_naming_the_argument(q_ids, kv_ids, message):
  q = jnp.ones((2, 16, 2, 8))
  k = jnp.ones((2, 24, 2, 8))
  with pytest.raises(ValueError, match=message):
    fa4_jax.attention(q, k, k, query_segment_ids=q_ids, key_value_segment_ids=kv_ids)


def test_cudnn_has_no_segment_ids_and_says_so():
  q = jnp.ones((1, 8, 1, 8))
  ids = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="has no `query_segment_ids`, `key_value_segment_ids`"):
    fa4_jax.attention(q, q, q, query_segment_ids=ids, key_value_segment_ids=ids,
                      implementation="cudnn")
