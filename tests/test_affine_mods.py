"""score_mods of the form a * score + R(q_idx) + C(kv_idx) in the sm90 kernels.

Specification:
* `mod_functions.affine_form` recognises a score_mod whose value on a tile
  is the score times a factor the same for the whole tile, plus terms of
  the query alone (R) and of the key alone (C): ALiBi (the slope read per
  head), `s + const`, `s + table[h, kv]`, `2 * s + bias[q]`; and rejects
  what is not separable (`s * s`, `table[h, q - k]`, |q - k|, a tanh, a
  mod without the score) and, in the decode arrangement's rows of several
  heads, a slope that differs from row to row.
* `mod_tiles.kernel_score_function`: a fixed factor joins the scale; with
  no C and no soft-cap the logits are the raw scores (the scale in the exp2
  constant, as without a mod); a soft-cap keeps the mod per score.
* Rounding: positions converted to float are split at an origin, so that
  far from position 0 the terms stay as small as the distance between
  query and key: within 4 float32 roundings of |x| + slope (|q - k| + 2 w)
  of the exact logit (w the tile's width) at positions near 2**17, where
  splitting slope * q - slope * k would be off by 0.004.
* Kernels in the interpreter with race detection, against jax.nn's XLA
  attention (float32) with the explicit bias: ALiBi causal with GQA,
  forward and gradients (the slopes' included); a key table with lengths
  (the table's gradient); a row bias and a constant with sinks (the lse,
  which must hold R); the decode arrangement, split into chunks, whose
  combine reads the lse. bf16 outputs at 2e-2 (P is rounded to bf16 for
  P V: 2^-9 relative), fp16 at 4e-3 (2^-12), the lse (f32 in the kernel)
  at 1e-3; gradients by the relative Frobenius error (`reference`): 2e-2
  in bf16 (dS and P are rounded to bf16 for the GEMMs).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import context_parallel, mod_functions
from fa4_jax.kernels import mod_tiles, sm90_decode, sm90_forward
from fa4_jax.scores import LOG2_E, MaskSpec, ScoreFunction, Scores
from reference import relative_error

SLOPES = jnp.asarray([2.0 ** -(i + 1) for i in range(8)], jnp.float32)
KEY_TABLE = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)), jnp.float32)
ROW_BIAS = jnp.asarray(np.random.default_rng(1).normal(size=(64,)), jnp.float32)


def _form(fn, decode_group=None):
  return mod_functions.affine_form(mod_functions.trace(fn, "score_mod")[0], decode_group)


# --- what the analysis recognises ---------------------------------------------------

AFFINE = {
    # name: (score_mod, its fixed factor, whether it has a term of the keys)
    "alibi": (lambda s, b, h, q, k: s - SLOPES[h] * (q - k).astype(jnp.float32), 1.0, True),
    "alibi, int times float": (lambda s, b, h, q, k: s + SLOPES[h] * (k - q), 1.0, True),
    "a constant": (lambda s, b, h, q, k: s + 0.5, 1.0, False),
    "a table read per key": (lambda s, b, h, q, k: s + KEY_TABLE[h, jnp.minimum(k, 63)], 1.0,
                             True),
    "twice the score and a row bias": (
        lambda s, b, h, q, k: s * 2 + ROW_BIAS[jnp.minimum(q, 63)], 2.0, False),
    "a halved sum": (lambda s, b, h, q, k: (s + SLOPES[h] * (k - q)) / 2, 0.5, True),
    "the score as it is": (lambda s, b, h, q, k: s, 1.0, False),
}


@pytest.mark.parametrize("name", list(AFFINE))
def test_separable_mods_are_recognised_with_their_factor_and_key_terms(name):
  fn, factor, key_terms = AFFINE[name]
  assert _form(fn) == mod_functions.AffineForm(factor=factor, key_terms=key_terms)


NOT_AFFINE = {
    "the score squared": lambda s, b, h, q, k: s * s,
    "a relative-position table": lambda s, b, h, q, k: s + KEY_TABLE[h, jnp.clip(k - q + 16, 0,
                                                                                  31)],
    "alibi of |q - k|": lambda s, b, h, q, k: s - SLOPES[h] * jnp.abs(q - k),
    "a tanh of the score": lambda s, b, h, q, k: jnp.tanh(s),
    "no score at all": lambda s, b, h, q, k: (q - k).astype(jnp.float32),
    "the score times a position": lambda s, b, h, q, k: s * q.astype(jnp.float32),
}


@pytest.mark.parametrize("name", list(NOT_AFFINE))
def test_mods_that_are_not_separable_are_not_recognised(name):
  assert _form(NOT_AFFINE[name]) is None


def test_a_factor_read_per_head_is_kept_for_the_tile():
  assert _form(lambda s, b, h, q, k: s * SLOPES[h] + 1.0) == mod_functions.AffineForm(
      factor=None, key_terms=False)


def test_packed_rows_of_several_heads_take_only_what_all_their_heads_share():
  alibi, constant = AFFINE["alibi"][0], AFFINE["a constant"][0]
  assert _form(alibi, decode_group=4) is None  # one slope per row: a product of two axes
  assert _form(alibi, decode_group=1) is not None
  assert _form(constant, decode_group=4) == mod_functions.AffineForm(1.0, key_terms=False)


def test_the_kernels_fold_a_fixed_factor_into_the_scale():
  mod = lambda fn: mod_functions.trace(fn, "score_mod")[0]
  plain = ScoreFunction(0.125)
  # No key terms: raw logits, the scale (times a) in the exp2 constant.
  row = mod_tiles.kernel_score_function(plain, mod(AFFINE["twice the score and a row bias"][0]))
  assert (row.scale, row.has_score_mod) == (0.25, False)
  assert row.exp2_constant == pytest.approx(0.25 * LOG2_E)
  # Key terms: one FMA per score, with the scale times a.
  halved = mod_tiles.kernel_score_function(plain, mod(AFFINE["a halved sum"][0]))
  assert (halved.scale, halved.has_score_mod) == (0.0625, True)
  # A factor read per head stays out of the scale.
  per_head = mod_tiles.kernel_score_function(plain, mod(lambda s, b, h, q, k: s * SLOPES[h]))
  assert (per_head.scale, per_head.has_score_mod) == (0.125, True)
  # Soft-cap: the row terms go inside the tanh, per score; a still joins the scale.
  capped = mod_tiles.kernel_score_function(ScoreFunction(0.125, 20.0),
                                           mod(AFFINE["twice the score and a row bias"][0]))
  assert (capped.scale, capped.has_score_mod) == (0.25, True)
  assert capped.exp2_constant == pytest.approx(20.0 * LOG2_E)
  # Not separable: as before.
  square = mod_tiles.kernel_score_function(plain, mod(NOT_AFFINE["the score squared"]))
  assert (square.scale, square.has_score_mod) == (0.125, True)


# --- rounding far from position 0 ----------------------------------------------------

SHAPE = (64, 128)


def _alibi_logits(slope, q0, k0, query_axis):
  """(the affine form's logit score + R + C of ALiBi on a tile whose queries
  start at q0 and keys at k0 (queries along `query_axis`), float32; the
  scores; the exact logit in float64; |q - k|)."""
  fn = lambda s, b, h, q, k: s - jnp.float32(slope) * (q - k).astype(jnp.float32)
  mod, _ = mod_functions.trace(fn, "score_mod")
  bound = mod_functions.bind(mod, [], 0, 0)
  key_axis = 1 - query_axis
  positions = lambda origin, axis: mod_functions.Positions(
      jnp.int32(origin), jnp.arange(SHAPE[axis], dtype=jnp.int32), axis, SHAPE)
  q_idx, kv_idx = positions(q0, query_axis), positions(k0, key_axis)
  factor, key, rest = bound.affine_parts(q_idx, kv_idx, query_axis)
  s = np.random.default_rng(2).normal(size=SHAPE).astype(np.float32) * 4
  logits = (jnp.asarray(s) * factor + key.tile()) + rest.tile()
  q = q0 + np.arange(SHAPE[query_axis]).reshape((-1, 1) if query_axis == 0 else (1, -1))
  k = k0 + np.arange(SHAPE[key_axis]).reshape((-1, 1) if key_axis == 0 else (1, -1))
  exact = s.astype(np.float64) - slope * (q - k).astype(np.float64)
  return np.asarray(logits, np.float64), s, exact, np.abs(q - k)


@pytest.mark.parametrize("query_axis", [0, 1])
@pytest.mark.parametrize("slope", [0.5, 2.0 ** -8])
@pytest.mark.parametrize("q0, k0", [(131072, 131000), (131072, 1000), (1000, 131072), (64, 0)])
def test_split_positions_stay_within_a_few_roundings_far_from_position_0(q0, k0, slope,
                                                                         query_axis):
  logits, s, exact, distance = _alibi_logits(slope, q0, k0, query_axis)
  width = max(SHAPE)
  allowed = 4 * 2.0 ** -24 * (np.abs(s) + slope * (distance + 2 * width))
  assert np.all(np.abs(logits - exact) <= allowed)


def test_splitting_at_position_0_would_not_be():
  # What the origin buys: slope * q - slope * k near the diagonal at 2**17.
  slope, q0, k0 = 0.5, 131072, 131000
  _, s, exact, distance = _alibi_logits(slope, q0, k0, 0)
  q = (q0 + np.arange(SHAPE[0]))[:, None].astype(np.float32)
  k = (k0 + np.arange(SHAPE[1]))[None, :].astype(np.float32)
  naive = (s - np.float32(slope) * q) + np.float32(slope) * k
  allowed = 4 * 2.0 ** -24 * (np.abs(s) + slope * (distance + 2 * max(SHAPE)))
  assert np.any(np.abs(naive - exact) > allowed)


# --- context_parallel_attention's ring steps ---------------------------------------
# Each ring step calls the kernels with the mod at the pair's global positions
# (`context_parallel._at_global_positions`): local i is global
# i + select(i < chunk, first, second - chunk).

CHUNK = 256  # a multiple of SHAPE's 64 and 128: tiles at multiples of them do not straddle


def _ring_step(fn):
  mod, _ = mod_functions.trace(fn, "score_mod")
  return context_parallel._at_global_positions(mod, CHUNK)


def test_a_ring_step_keeps_the_affine_form():
  assert mod_functions.affine_form(_ring_step(AFFINE["alibi"][0])) == mod_functions.AffineForm(
      factor=1.0, key_terms=True)
  assert mod_functions.affine_form(_ring_step(AFFINE["a constant"][0])) == (
      mod_functions.AffineForm(factor=1.0, key_terms=False))
  for name in ("alibi of |q - k|", "the score squared", "a relative-position table"):
    assert mod_functions.affine_form(_ring_step(NOT_AFFINE[name])) is None, name


# (first, second) chunk starts of the rows and of the keys: chunks 0 and 7 of
# a ring of 4 against chunks 2 and 5, at 2**17 + ... far from position 0.
FAR = 2 ** 17
STARTS = (FAR, FAR + 7 * CHUNK, FAR + 2 * CHUNK, FAR + 5 * CHUNK)


def _ring_step_logits(q0, k0, query_axis, aligned):
  """(ALiBi's logits, slope 0.5, by the affine form of a ring step on a tile
  whose local rows start at q0 and keys at k0; the scores; the exact logits
  at the global positions, float64; |q - k| there). `aligned`: the tile's
  positions say their origins are multiples of its extents (as the kernels'
  do), and reading their vectors fails."""
  slope = 0.5
  fn = lambda s, b, h, q, k: s - jnp.float32(slope) * (q - k).astype(jnp.float32)
  starts = [mod_functions.kernel_operand(jnp.int32(x)) for x in STARTS]
  bound = mod_functions.bind(_ring_step(fn), starts, 0, 0)
  key_axis = 1 - query_axis

  def positions(origin, axis):
    if not aligned:
      return mod_functions.Positions(
          jnp.int32(origin), jnp.arange(SHAPE[axis], dtype=jnp.int32), axis, SHAPE)
    assert origin % SHAPE[axis] == 0

    def no_vector():
      raise AssertionError("a ring step on an aligned tile read a position vector")

    return mod_functions.Positions(jnp.int32(origin), jnp.arange(SHAPE[axis], dtype=jnp.int32),
                                   axis, SHAPE, vector=no_vector, align=SHAPE[axis])

  factor, key, rest = bound.affine_parts(positions(q0, query_axis), positions(k0, key_axis),
                                         query_axis)
  s = np.random.default_rng(3).normal(size=SHAPE).astype(np.float32) * 4
  logits = np.asarray((jnp.asarray(s) * factor + key.tile()) + rest.tile(), np.float64)
  at_global = lambda i, first, second: i + np.where(i < CHUNK, first, second - CHUNK)
  local = lambda origin, axis: origin + np.arange(SHAPE[axis]).reshape(
      (-1, 1) if axis == 0 else (1, -1))
  q = at_global(local(q0, query_axis), *STARTS[:2])
  k = at_global(local(k0, key_axis), *STARTS[2:])
  exact = s.astype(np.float64) - slope * (q - k).astype(np.float64)
  return logits, s, exact, np.abs(q - k), slope


@pytest.mark.parametrize("query_axis", [0, 1])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("q0, k0", [(0, 0), (256, 128), (384, 0)],
                         ids=["first-first", "second-first", "second-first-far"])
def test_a_ring_step_forms_the_global_logits(q0, k0, aligned, query_axis):
  # Tiles within one chunk each: as plain positions, within 4 roundings of
  # slope (|q - k| + 2 w); aligned ones with a scalar shift, no op on the
  # position vectors.
  logits, s, exact, distance, slope = _ring_step_logits(q0, k0, query_axis, aligned)
  allowed = 4 * 2.0 ** -24 * (np.abs(s) + slope * (distance + 2 * max(SHAPE)))
  assert np.all(np.abs(logits - exact) <= allowed)


@pytest.mark.parametrize("query_axis", [0, 1])
def test_a_ring_step_forms_the_global_logits_across_the_chunk_boundary(query_axis):
  # A tile across it (only where the chunk is no multiple of the kernel's
  # tile): exact integers still, the terms rounded as large as the distance
  # between the chunks.
  logits, s, exact, distance, slope = _ring_step_logits(224, 200, query_axis, aligned=False)
  distance = distance + STARTS[1] - STARTS[0]
  allowed = 4 * 2.0 ** -24 * (np.abs(s) + slope * (distance + 2 * max(SHAPE)))
  assert np.all(np.abs(logits - exact) <= allowed)


# --- the kernels, interpreted -----------------------------------------------------------


def _inputs(b, t, s, n, kv_heads, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, d), dtype)
  k = jax.random.normal(keys[1], (b, s, kv_heads, d), dtype)
  v = jax.random.normal(keys[2], (b, s, kv_heads, d), dtype) + 1.0
  dout = jax.random.normal(keys[3], (b, t, n, d), dtype)
  return q, k, v, dout


def _jax_nn(q, k, v, bias, **kwargs):
  """jax.nn's XLA attention in float32 with an explicit bias [1|B, N, T, S]."""
  f32 = lambda x: x.astype(jnp.float32)
  return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), bias=bias, implementation="xla",
                                      **kwargs)


def _check_grads(got, want, names):
  for name, g, w in zip(names, got, want):
    g = np.asarray(g, np.float32)
    assert np.isfinite(g).all(), name
    assert relative_error(g, np.asarray(w, np.float32)) < 2e-2, name


def test_alibi_causal_with_gqa_matches_jax_nn_forward_and_gradients(run_interpreted):
  b, t, n, kv_heads, d = 1, 136, 2, 1, 64
  q, k, v, dout = _inputs(b, t, t, n, kv_heads, d, jnp.bfloat16)
  slopes = SLOPES[:n]

  def loss(attend):
    def f(q, k, v, slopes):
      out = attend(q, k, v, slopes)
      return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out
    return jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True)

  def ours(q, k, v, slopes):
    alibi = lambda s_, bb, h, qi, kv: s_ - slopes[h] * (qi - kv).astype(jnp.float32)
    return fa4_jax.attention(q, k, v, is_causal=True, score_mod=alibi, implementation="sm90")

  def reference(q, k, v, slopes):
    distance = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]).astype(jnp.float32)
    return _jax_nn(q, k, v, -slopes[None, :, None, None] * distance, is_causal=True)

  got, out = run_interpreted(loss(ours), q, k, v, slopes)
  want, want_out = loss(reference)(q, k, v, slopes)
  np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2, rtol=2e-2)
  _check_grads(got, want, ("dq", "dk", "dv", "dslopes"))


def test_a_key_table_with_lengths_gets_its_gradient(run_interpreted):
  b, t, s, n, kv_heads, d = 1, 72, 136, 2, 1, 64
  q, k, v, dout = _inputs(b, t, s, n, kv_heads, d, jnp.bfloat16, seed=1)
  lengths = jnp.asarray([101], jnp.int32)

  def f(attend):
    def loss(q, k, v, table):
      return jnp.sum(attend(q, k, v, table).astype(jnp.float32) * dout.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))

  def ours(q, k, v, table):
    return fa4_jax.attention(q, k, v, key_value_seq_lengths=lengths, implementation="sm90",
                             score_mod=lambda s_, bb, h, qi, kv: s_ + table[h, jnp.minimum(kv, 63)])

  def reference(q, k, v, table):
    bias = table[:n, jnp.minimum(jnp.arange(s), 63)][None, :, None, :]
    return _jax_nn(q, k, v, jnp.broadcast_to(bias, (1, n, t, s)),
                   key_value_seq_lengths=lengths)

  got = run_interpreted(f(ours), q, k, v, KEY_TABLE)
  want = f(reference)(q, k, v, KEY_TABLE)
  _check_grads(got, want, ("dq", "dk", "dv", "dtable"))


# Key and query terms each near +-3000 (natural units: 24000 in raw-score
# units at d 64) whose sum stays moderate, beside ALiBi: the backward's
# accumulators start at C / m + (R2 - lse2) / k (`DkvConfig.fold_affine`),
# two large numbers that cancel where P matters.
FAR = 300_000  # positions moved this far, times 0.01


@pytest.mark.parametrize("causal,scores", [(False, True), (True, True), (True, False)])
def test_the_backward_folds_large_key_and_row_terms_into_its_accumulators(
    causal, scores, monkeypatch, run_interpreted):
  # GQA 2/1 with key lengths (dense) or causal: PARTIAL and FULL steps;
  # ALiBi beside the large terms; each kernel starts S (S^T) at the form's
  # terms. The slopes' gradient is checked under the causal mask: dense,
  # where the last keys dominate every row, it is a sum of dS * (k - q)
  # whose terms cancel, and the XLA path's own bf16 gradient is off by
  # tens of percent with or without the fold (the notes, "The ALiBi
  # backward's registers").
  b, t, s, n, kv_heads, d = 1, 72, 136, 2, 1, 64
  lengths = jnp.asarray([101], jnp.int32)
  if causal:  # square, without lengths (jax.nn's causal mask is top-left)
    t, lengths = s, None
  q, k, v, dout = _inputs(b, t, s, n, kv_heads, d, jnp.bfloat16, seed=6)
  from fa4_jax.kernels import sm90_backward
  monkeypatch.setattr(sm90_backward, "FOLD_AFFINE_SCORE_MOD", True)  # the default
  monkeypatch.setattr(sm90_backward, "FOLD_AFFINE_SCORES", scores)  # False: dQ's delta alone
  started = []
  init = mod_tiles.affine_scores_init
  monkeypatch.setattr(mod_tiles, "affine_scores_init",
                      lambda *a, **kw: started.append(kw["query_axis"]) or init(*a, **kw))

  def grads(attend):
    def loss(q, k, v, slopes):
      out = attend(q, k, v, slopes)
      return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))

  def ours(q, k, v, slopes):
    def mod(s_, bb, h, qi, kv):
      alibi = slopes[h] * (kv - qi).astype(jnp.float32)
      far = 0.01 * (kv + FAR).astype(jnp.float32) - 0.01 * (qi + FAR).astype(jnp.float32)
      return s_ + alibi + far
    return fa4_jax.attention(q, k, v, is_causal=causal, key_value_seq_lengths=lengths,
                             score_mod=mod, implementation="sm90")

  def reference(q, k, v, slopes):
    rel = (jnp.arange(s)[None, :] - jnp.arange(t)[:, None]).astype(jnp.float32)
    far = (0.01 * (jnp.arange(s) + FAR).astype(jnp.float32)[None, :]
           - 0.01 * (jnp.arange(t) + FAR).astype(jnp.float32)[:, None])
    bias = slopes[None, :, None, None] * rel + far
    return _jax_nn(q, k, v, bias, is_causal=causal, key_value_seq_lengths=lengths)

  got = run_interpreted(grads(ours), q, k, v, SLOPES[:n])
  want = grads(reference)(q, k, v, SLOPES[:n])
  # the dQ kernel (queries along rows) and dK/dV
  assert sorted(set(started)) == ([0, 1] if scores else [])
  names = ("dq", "dk", "dv", "dslopes") if causal else ("dq", "dk", "dv")
  _check_grads(got, want, names)


def test_the_backward_of_a_mod_without_key_terms_folds_delta_alone(monkeypatch, run_interpreted):
  from fa4_jax.kernels import sm90_backward
  monkeypatch.setattr(sm90_backward, "FOLD_AFFINE_SCORE_MOD", True)  # the default
  # 2 s + R(q) + 0.5: no key term, so S starts at 0 (the logits are the raw
  # S) and only the dQ kernel's dP starts at -delta; factor 2 in the scale.
  b, t, s, n, kv_heads, d = 1, 72, 136, 2, 1, 64
  q, k, v, dout = _inputs(b, t, s, n, kv_heads, d, jnp.bfloat16, seed=7)

  def grads(attend):
    def loss(q, k, v):
      return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))

  mod = lambda s_, bb, h, qi, kv: 2 * s_ + ROW_BIAS[jnp.minimum(qi, 63)] + 0.5
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, score_mod=mod, implementation="sm90")
  bias = jnp.broadcast_to(ROW_BIAS[jnp.minimum(jnp.arange(t), 63)][:, None] + 0.5, (1, n, t, s))
  reference = lambda q, k, v: _jax_nn(q, k, v, bias, scale=2 * d ** -0.5)
  _check_grads(run_interpreted(grads(ours), q, k, v), grads(reference)(q, k, v),
               ("dq", "dk", "dv"))


def test_the_affine_fold_is_a_switch_of_the_score_mod_configs(monkeypatch):
  from fa4_jax.kernels import sm90_backward
  from fa4_jax.kernels.mod_tiles import folds_affine
  for switch in (True, False):
    monkeypatch.setattr(sm90_backward, "FOLD_AFFINE_SCORE_MOD", switch)
    config = sm90_backward.choose_mods_config(128, MaskSpec(right=0), score_mod=True,
                                              mask_mod=False)
    assert config.dkv.fold_affine == config.dq.fold_affine == config.dq.fold_delta == switch
  config = sm90_backward.choose_mods_config(128, MaskSpec(), score_mod=False)
  assert not (config.dkv.fold_affine or config.dq.fold_affine or config.dq.fold_delta)
  mod = lambda fn: mod_functions.trace(fn, "score_mod")[0]
  alibi = mod(AFFINE["alibi"][0])
  assert folds_affine(alibi, ScoreFunction(0.125))
  assert not folds_affine(alibi, ScoreFunction(0.125, cap=30.0))  # the tanh needs the raw S
  assert not folds_affine(mod(lambda s, b, h, q, k: s * SLOPES[h]), ScoreFunction(0.125))
  assert not folds_affine(mod(lambda s, b, h, q, k: s * s), ScoreFunction(0.125))
  assert not folds_affine(None, ScoreFunction(0.125))


def test_a_row_bias_and_a_constant_with_sinks_keep_the_lse(run_interpreted):
  # No key terms: raw logits, twice the scale in the exp2 constant, and
  # R + 0.5 in the rows' running max, which starts at the sink.
  b, t, s, n, kv_heads, d = 1, 130, 190, 2, 1, 128
  q, k, v, _ = _inputs(b, t, s, n, kv_heads, d, jnp.float16, seed=2)
  scale = d ** -0.5
  sinks = jnp.asarray([0.5, 3.0], jnp.float32)
  fn = lambda s_, bb, h, qi, kv: 2 * s_ + ROW_BIAS[jnp.minimum(qi, 63)] + 0.5
  mod, captured = mod_functions.trace(fn, "score_mod")
  assert not mod_tiles.kernel_score_function(ScoreFunction(scale), mod).has_score_mod
  mods = Scores(score_mod=mod, score_captured=captured)
  out, lse = run_interpreted(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(scale), mask=MaskSpec(), sinks=sinks,
      mods=mods), q, k, v)
  # The reference: logits 2 * scale * q.k + R + 0.5, and the sink as one more key of value 0.
  f32 = lambda x: x.astype(jnp.float32)
  row = ROW_BIAS[jnp.minimum(jnp.arange(t), 63)][:, None] + 0.5
  logits = 2 * scale * jnp.einsum("btnd,bsnd->bnts", f32(q), jnp.repeat(f32(k), n, 2)) + row
  sink = jnp.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))
  want_lse = jax.nn.logsumexp(jnp.concatenate([logits, sink], -1), -1)
  probs = jnp.exp(logits - want_lse[..., None])
  want = jnp.einsum("bnts,bsnd->btnd", probs, jnp.repeat(f32(v), n, 2))
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3, rtol=4e-3)
  np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-4)


def test_the_decode_arrangement_combines_chunks_by_the_lse(monkeypatch, run_interpreted):
  # G 4 heads per row tile, 512 keys in chunks of 128: the key term reads
  # each chunk's positions in the sequence, the chunks' outputs are merged
  # by their lse, and the lse returned (`return_residual`) holds the
  # constant, the same in every chunk.
  monkeypatch.setattr(sm90_decode, "MIN_CHUNK", 128)
  b, t, s, n, kv_heads, d = 1, 1, 512, 8, 2, 64
  q, k, v, _ = _inputs(b, t, s, n, kv_heads, d, jnp.bfloat16, seed=3)
  lengths = jnp.asarray([300], jnp.int32)  # 3 chunks with keys, one without
  fn = lambda s_, bb, h, qi, kv: 2 * s_ + 0.01 * kv.astype(jnp.float32) + 0.25
  assert _form(fn, decode_group=n // kv_heads) == mod_functions.AffineForm(2.0, key_terms=True)
  options = dict(key_value_seq_lengths=lengths, score_mod=fn, implementation="sm90")
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, **options) == "sm90_decode"
  out, lse = run_interpreted(lambda q, k, v: fa4_jax.attention(
      q, k, v, return_residual=True, **options), q, k, v)
  bias = jnp.broadcast_to(0.01 * jnp.arange(s, dtype=jnp.float32) + 0.25, (1, n, t, s))
  want = _jax_nn(q, k, v, bias, scale=2 * d ** -0.5, key_value_seq_lengths=lengths)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
  f32 = lambda x: x.astype(jnp.float32)
  logits = 2 * d ** -0.5 * jnp.einsum("btnd,bsnd->btns", f32(q), jnp.repeat(f32(k), n // kv_heads,
                                                                             2))
  logits = logits + bias.transpose(0, 2, 1, 3)
  want_lse = jax.nn.logsumexp(jnp.where(jnp.arange(s) < lengths[0], logits, -jnp.inf), -1)
  # The residual comes in the keys' dtype: bf16 holds |lse| ~ 5 to 2^-8 of it.
  np.testing.assert_allclose(np.asarray(lse, np.float32), want_lse, atol=2e-2, rtol=1e-2)
