"""score_mod / mask_mod in the decode arrangement, contiguous and paged.

Specification:
* Short queries with a `score_mod` / `mask_mod` run in the decode
  arrangement of `fa4_jax.kernels.sm90_decode` (which_implementation says
  "sm90_decode"; paged calls "sm90"), T x G packed rows per KV head, split
  into chunks of keys: row r of a tile holds token r // G of query head
  kv_head * G + r % G, so the mod sees per row its `head` and its `q_idx`
  (the query's index as passed, 0 .. T-1, as the XLA path and the docs give
  it, also under bottom-right alignment), and per key its position in the
  sequence (`kv_idx`, chunk * C + j), `batch` the sequence.
* Numerics (interpreter with race detection) against an f32 einsum with
  the explicit bias and mask: ALiBi (slopes[head] * (kv - q)), a 2-D table
  lookup (table[head, (kv + q) % 8]), mask_mods that read a per-batch
  array and a head-only condition (whole key blocks EMPTY: skipped), a
  decode sliding window; G in {1, 2, 4}, T in {1, 3}, ragged lengths (0, a
  chunk boundary, full), causal bottom-right and not; pages of 16 through
  a shuffled table; chunks of 128 keys (split-K on small caches).
  Gradients of a paged call with mods (to q and to a captured array) are
  the XLA path's. bf16 tolerance 2e-2: the kernel's P is rounded to bf16
  for P V (relative 2^-9 per weight) and the output to bf16 (2^-9 of |out|
  <= ~4), the reference is exact f32.
* A mod the kernel runs on a tile of one head but not on packed rows (a
  captured row indexed by the head, then read per element) keeps the
  forward kernel for `attention` and the XLA path for pages (sm90 named:
  a ValueError saying why).
* `mod_functions.bind_rows` gives each row what `bind` gives its head.
* B8 T1 S32768 Hq32 Hkv8 D128 with ALiBi lowers for sm_90, contiguous and
  in pages of 64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends, mod_functions
from fa4_jax.kernels import sm90_decode, sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from reference import einsum_attention
from test_paged import _paged_cache as paged_cache

TOL = 2e-2


def _inputs(seed, b, t, s, n, kv_heads, d=64):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16),
          jax.random.normal(keys[1], (b, s, kv_heads, d), jnp.bfloat16),
          jax.random.normal(keys[2], (b, s, kv_heads, d), jnp.bfloat16) + 1.0)


def _slopes(n):
  return jnp.asarray([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)], jnp.float32)


def _alibi(slopes):
  return lambda s, b, h, q, kv: s + slopes[h] * (kv - q).astype(jnp.float32)


def _alibi_bias(slopes, t, s):
  """[1, N, T, S]: slopes[h] * (kv - q), q the query's index 0 .. T-1."""
  dist = np.arange(s)[None, :] - np.arange(t)[:, None]
  return jnp.asarray(np.asarray(slopes)[:, None, None] * dist, jnp.float32)[None]


def _visible(t, s, lengths, causal):
  """[B, 1, T, S]: key j < L, and with `causal` j <= L - T + t."""
  lengths = np.asarray(lengths)
  j = np.arange(s)[None, None, :]
  ok = np.broadcast_to(j < lengths[:, None, None], (len(lengths), t, s))
  if causal:
    ok = ok & (j <= (lengths[:, None] - t + np.arange(t)[None, :])[:, :, None])
  return ok[:, None]


def _check(out, want_out, visible):
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, np.asarray(want_out), atol=TOL, rtol=TOL)
  seen = np.asarray(visible).any(-1)  # [B, H|1, T]: rows that see nothing get zeros
  blind = ~np.broadcast_to(seen, (out.shape[0], out.shape[2], out.shape[1])).transpose(0, 2, 1)
  assert np.all(out[blind] == 0.0)


@pytest.fixture
def short_chunks(monkeypatch):
  """Chunks of 128 keys: split-K on the interpreter's small caches."""
  monkeypatch.setattr(sm90_decode, "MIN_CHUNK", 128)


def _gathered(pages, table):
  b, max_pages = table.shape
  _, page_size, kv_heads, d = pages.shape
  return jnp.asarray(np.asarray(pages, np.float32)[np.asarray(table)].reshape(
      b, max_pages * page_size, kv_heads, d))


# --- contiguous caches through fa4_jax.attention ----------------------------------


def test_alibi_and_a_mask_mod_that_empties_whole_blocks_at_t1(short_chunks, run_interpreted):
  # G 4, T 1, 512 keys in chunks of 128. ALiBi; the mask_mod hides each
  # row's keys below skip[b] from every head (whole blocks and chunks: EMPTY,
  # never walked; all of row 2's keys) and from odd heads the keys with
  # kv % 3 == 1 (a head-only condition of the packed rows, and-ed per element).
  b, t, n, kv_heads, s = 3, 1, 8, 2, 512
  q, k, v = _inputs(0, b, t, s, n, kv_heads)
  lengths = jnp.asarray([300, 0, 129], jnp.int32)
  skip = jnp.asarray([140, 0, 200], jnp.int32)
  slopes = _slopes(n)
  mask_mod = lambda bb, h, qi, kv: (kv >= skip[bb]) & ((h % 2 == 0) | (kv % 3 != 1))
  options = dict(score_mod=_alibi(slopes), mask_mod=mask_mod, implementation="sm90")
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, key_value_seq_lengths=lengths,
                                        **options) == "sm90_decode"
    assert sm90_decode.plan(q.shape, k.shape, MaskSpec(), ragged=True).splits == 4
  out = run_interpreted(lambda q, k, v, n: fa4_jax.attention(
      q, k, v, key_value_seq_lengths=n, **options), q, k, v, lengths)
  h, j = np.arange(n)[None, :, None, None], np.arange(s)[None, None, None, :]
  keep = (j >= np.asarray(skip)[:, None, None, None]) & ((h % 2 == 0) | (j % 3 != 1))
  visible = _visible(t, s, lengths, False) & keep
  want, _ = einsum_attention(q, k, v, visible, bias=_alibi_bias(slopes, t, s))
  _check(out, want, visible)


def test_causal_tokens_with_a_table_lookup(short_chunks, run_interpreted):
  # G 2, T 3 bottom-right causal, 512 keys in chunks of 128: a 2-D lookup
  # table[head, (kv + q) % 8]; a row of 2 keys leaves its first query blind.
  b, t, n, kv_heads, s = 2, 3, 4, 2, 512
  q, k, v = _inputs(1, b, t, s, n, kv_heads)
  lengths = jnp.asarray([258, 2], jnp.int32)
  table = jnp.asarray(np.random.default_rng(2).normal(size=(n, 8)), jnp.float32)
  score_mod = lambda sc, bb, h, qi, kv: sc + table[h, (kv + qi) % 8]
  options = dict(score_mod=score_mod, is_causal=True, causal_alignment="bottom_right",
                 implementation="sm90")
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, key_value_seq_lengths=lengths,
                                        **options) == "sm90_decode"
  out = run_interpreted(lambda q, k, v, n: fa4_jax.attention(
      q, k, v, key_value_seq_lengths=n, **options), q, k, v, lengths)
  h = np.arange(n)[None, :, None, None]
  i, j = np.arange(t)[None, None, :, None], np.arange(s)[None, None, None, :]
  bias = jnp.asarray(np.asarray(table)[h, (j + i) % 8], jnp.float32)
  visible = _visible(t, s, lengths, True)
  want, _ = einsum_attention(q, k, v, visible, bias=bias)
  _check(out, want, visible)


# --- paged caches through fa4_jax.paged_attention ---------------------------------


def test_paged_alibi_and_a_sliding_window_mask_mod_at_t1(short_chunks, run_interpreted):
  # G 4; pages of 16 shuffled, 512 keys a row in four chunks; the window:
  # each row's last 200 keys (its length read per batch in the mask_mod).
  # Gradients (to q and to the slopes, a captured array) are the XLA path's
  # over the gathered pages (`paged._kernel_forward`'s VJP).
  args = paged_cache(3, dtype=jnp.bfloat16, batch=3, t=1, q_heads=4, kv_heads=1, head_dim=64,
                     page_size=16, max_pages=32, lengths=(500, 0, 290))
  q, kp, vp, table, lengths = args
  slopes = _slopes(4)
  window = lambda b, h, qi, kv: kv >= lengths[b] - 200
  dout = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

  def loss(q, slopes, implementation):
    out = fa4_jax.paged_attention(q, kp, vp, table, lengths, score_mod=_alibi(slopes),
                                  mask_mod=window, implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dout), out

  with fa4_jax.interpret_mode():
    assert fa4_jax.which_paged_implementation(*args, score_mod=_alibi(slopes), mask_mod=window,
                                              implementation="sm90") == "sm90"
  (_, out), grads = run_interpreted(jax.value_and_grad(
      lambda q, s: loss(q, s, "sm90"), argnums=(0, 1), has_aux=True), q, slopes)
  j = np.arange(512)[None, None, None, :]
  visible = _visible(1, 512, lengths, False) & (j >= np.asarray(lengths)[:, None, None, None]
                                                 - 200)
  want, _ = einsum_attention(q, _gathered(kp, table), _gathered(vp, table), visible,
                             bias=_alibi_bias(slopes, 1, 512))
  _check(out, want, visible)
  want_grads = jax.grad(lambda q, s: loss(q, s, "xla")[0], argnums=(0, 1))(q, slopes)
  for got, expected in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               atol=TOL, rtol=TOL)


def test_paged_causal_tokens_with_a_table_lookup(short_chunks, run_interpreted):
  # G 1 (one head a tile), T 3 causal (bottom-right by each row's length),
  # pages of 16, chunks of 128 keys (258: the last tokens straddle a chunk
  # boundary).
  args = paged_cache(4, dtype=jnp.bfloat16, batch=2, t=3, q_heads=2, kv_heads=2, head_dim=64,
                     page_size=16, max_pages=32, lengths=(258, 1))
  q, kp, vp, table, lengths = args
  bias_table = jnp.asarray(np.random.default_rng(5).normal(size=(2, 8)), jnp.float32)
  score_mod = lambda s, b, h, qi, kv: s + bias_table[h, (kv + qi) % 8]
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(
      *a, score_mod=score_mod, implementation="sm90"), *args)
  h = np.arange(2)[None, :, None, None]
  i, j = np.arange(3)[None, None, :, None], np.arange(512)[None, None, None, :]
  bias = jnp.asarray(np.asarray(bias_table)[h, (j + i) % 8], jnp.float32)
  visible = _visible(3, 512, lengths, True)
  want, _ = einsum_attention(q, _gathered(kp, table), _gathered(vp, table), visible, bias=bias)
  _check(out, want, visible)


# --- selection ---------------------------------------------------------------------


@pytest.fixture
def hopper(monkeypatch):
  monkeypatch.setattr(backends, "device_arch_major", lambda: 9)


# A captured row of a table indexed by the head, then read per element: the
# kernels read it on a tile of one head, not on rows of several heads.
_ROWS = jnp.asarray(np.random.default_rng(6).normal(size=(8, 8)), jnp.float32)
_HEAD_ROW_THEN_ELEMENT = lambda s, b, h, q, kv: s + _ROWS[h][kv % 8]


def test_selection_takes_the_arrangement_with_mods(hopper):
  q, k, v = _inputs(7, 2, 1, 2048, 8, 2)
  alibi = _alibi(_slopes(8))
  assert fa4_jax.which_implementation(q, k, v, score_mod=alibi) == "sm90_decode"
  assert fa4_jax.which_implementation(q, k, v, mask_mod=lambda b, h, i, j: j > h) == \
      "sm90_decode"
  # Not on packed rows: the forward kernel as it is.
  assert mod_functions.packed_rows_problem(
      mod_functions.trace(_HEAD_ROW_THEN_ELEMENT, "score_mod")[0]) is not None
  assert fa4_jax.which_implementation(q, k, v, score_mod=_HEAD_ROW_THEN_ELEMENT) == "sm90"
  # Pages: the kernel with mods; what it cannot run on packed rows, the XLA path.
  args = paged_cache(8, dtype=jnp.bfloat16, batch=2, t=1, q_heads=8, kv_heads=2, head_dim=64,
                     page_size=16, max_pages=8, lengths=(100, 7))
  assert fa4_jax.which_paged_implementation(*args, score_mod=alibi) == "sm90"
  assert fa4_jax.which_paged_implementation(*args, mask_mod=lambda b, h, i, j: j > h) == "sm90"
  assert fa4_jax.which_paged_implementation(*args, score_mod=_HEAD_ROW_THEN_ELEMENT) == "xla"
  with pytest.raises(ValueError, match="packed rows"):
    fa4_jax.which_paged_implementation(*args, score_mod=_HEAD_ROW_THEN_ELEMENT,
                                       implementation="sm90")
  with pytest.raises(ValueError, match="'sin'"):
    fa4_jax.which_paged_implementation(*args, score_mod=lambda s, b, h, i, j: jnp.sin(s),
                                       implementation="sm90")
  # Beyond the arrangement's rows (chunked prefill): the XLA path.
  long_query = paged_cache(8, dtype=jnp.bfloat16, batch=1, t=300, q_heads=8, kv_heads=2,
                           head_dim=64, page_size=16, max_pages=32, lengths=(500,))
  assert fa4_jax.which_paged_implementation(*long_query) == "sm90"
  assert fa4_jax.which_paged_implementation(*long_query, score_mod=alibi) == "xla"


def test_bind_rows_gives_each_row_what_bind_gives_its_head():
  shape = (16, 32)
  rng = np.random.default_rng(9)
  slopes = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
  table = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  mods = [
      ("score_mod", lambda s, b, h, q, kv: s + slopes[h] * (kv - q).astype(jnp.float32)),
      ("score_mod", lambda s, b, h, q, kv: s * (h + 1) + table[h, (kv + q) % 8]),
      ("mask_mod", lambda b, h, q, kv: (h % 2 == 0) | (kv > q + h)),
  ]
  heads = [4, 5, 6, 7]
  member = jnp.arange(shape[0], dtype=jnp.int32) % 4
  q_idx = jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None] // 4, shape)
  kv_idx = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32)[None, :], shape)
  score = jnp.asarray(rng.normal(size=shape), jnp.float32)
  for kind, fn in mods:
    mod, captured = mod_functions.trace(fn, kind)
    refs = [mod_functions.kernel_operand(c) for c in captured]
    args = ([score] if kind == "score_mod" else []) + [q_idx, kv_idx]
    got = mod_functions.bind_rows(mod, refs, 1, heads,
                                  mod_functions.Along(member, 0, shape))(*args)
    got = np.asarray(jnp.broadcast_to(got, shape))
    for g, head in enumerate(heads):
      want = np.asarray(jnp.broadcast_to(mod_functions.bind(mod, refs, 1, head)(*args), shape))
      rows = np.asarray(member) == g
      np.testing.assert_array_equal(got[rows], want[rows])


# --- cross-lowering for Hopper ----------------------------------------------------


@pytest.mark.parametrize("page_size", [None, 64])
def test_alibi_decode_lowers_for_hopper(page_size, cross_lower):
  b, s, n, kv_heads, d = 8, 32768, 32, 8, 128
  q = jax.ShapeDtypeStruct((b, 1, n, d), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  score_mod, captured = mod_functions.trace(_alibi(_slopes(n)), "score_mod")
  mods = Scores(score_mod=score_mod, score_captured=captured)
  plan = sm90_decode.plan(q.shape, (b, s, kv_heads, d), MaskSpec(), ragged=True,
                          granule=page_size or 1, num_sms=132, streams=64)
  options = dict(score=ScoreFunction(d ** -0.5), mask=MaskSpec(), plan=plan, mods=mods)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.bfloat16)
    lowered = cross_lower(lambda q, k, v, n: sm90_decode.forward(q, k, v, None, n, **options)[0],
                          q, kv, kv, lengths)
  else:
    pages = jax.ShapeDtypeStruct((b * s // page_size, page_size, kv_heads, d), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((b, s // page_size), jnp.int32)
    lowered = cross_lower(lambda q, k, v, p, n: sm90_decode.forward(
        q, k, v, None, n, page_table=p, **options)[0], q, pages, pages, table, lengths)
  assert len(lowered.modules) == 1
  assert lowered.max_smem_bytes <= sm90_forward.SMEM_LIMIT_BYTES
  for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity"):
    assert lowered.has(instruction)
