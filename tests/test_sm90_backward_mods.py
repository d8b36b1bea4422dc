"""`score_mod` and `mask_mod` in the Hopper backward kernels, checked on the CPU.

* Numerics and barrier protocol: jax.grad of `fa4_jax.attention(...,
  implementation="sm90")` (the sm90 forward, then the sm90 backward) runs in
  Pallas' GPU interpreter with race detection, at small, odd shapes; dq, dk,
  dv (and the gradient of a score_mod's captured array, which `backends`
  computes with one XLA pass) must match jax.grad of an f32 einsum attention
  with the equivalent explicit bias and boolean mask (`reference`).
* The block lists: EMPTY tiles are never walked, and the lists of a reused
  `create_block_mask` block mask are those of its mask_mod.
* Selection: `which_implementation(part="backward")` names the sm90 backward.
* Hardware fit: every configuration `choose_mods_config` picks, with a
  score_mod and a mask_mod, is cross-lowered for sm_90 and must fit the
  shared memory and use wgmma and TMA.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import mod_functions
from fa4_jax.kernels import sm90_backward
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import einsum_attention, packed_segment_ids, relative_error, visible_mask


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int = 1
  q_seq: int = 72
  kv_seq: int = 136
  q_heads: int = 2
  kv_heads: int = 1
  head_dim: int = 64
  dtype: str = "bfloat16"
  is_causal: bool = False
  q_lengths: tuple | None = None
  kv_lengths: tuple | None = None
  soft_cap: float | None = None
  alibi: bool = False  # score_mod: ALiBi with captured per-head slopes
  mask: str | None = None  # mask_mod: a name in MASK_MODS
  block_mask: bool = False  # the mask_mod given as a `create_block_mask` block mask
  segments: tuple | None = None  # document lengths of each row (q and kv alike)

  def inputs(self, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    dtype = jnp.dtype(self.dtype)
    q_shape = (self.batch, self.q_seq, self.q_heads, self.head_dim)
    kv_shape = (self.batch, self.kv_seq, self.kv_heads, self.head_dim)
    q = jax.random.normal(keys[0], q_shape, dtype)
    k = jax.random.normal(keys[1], kv_shape, dtype)
    v = 1.0 + jax.random.normal(keys[2], kv_shape, dtype)
    dout = jax.random.normal(keys[3], q_shape, dtype)
    slopes = 2.0 ** (-8.0 * (1 + jnp.arange(self.q_heads, dtype=jnp.float32)) / self.q_heads)
    return q, k, v, dout, slopes

  def segment_ids(self):
    if self.segments is None:
      return None
    assert self.q_seq == self.kv_seq
    return jnp.asarray(np.stack([packed_segment_ids(lens, self.q_seq)
                                 for lens in self.segments]), jnp.int32)


def _prefix_lm(b, h, q_idx, kv_idx):
  """Prefix-LM: the first 40 keys are seen by every row, the rest causally."""
  return (kv_idx < 40) | (kv_idx <= q_idx)


def _block_sparse(b, h, q_idx, kv_idx):
  """Block-diagonal in blocks of 128 positions, plus 16 global keys; row 7
  sees no key and head 1 drops every fifth key."""
  blocks = (q_idx // 128 == kv_idx // 128) | (kv_idx < 16)
  return blocks & (q_idx != 7) & ((h == 0) | (kv_idx % 5 != 0))


def _chunked(b, h, q_idx, kv_idx):
  """Chunked local attention (chunks of 48 positions), per batch row a
  different shift."""
  return (q_idx + 16 * b) // 48 == (kv_idx + 16 * b) // 48


MASK_MODS = {"prefix_lm": _prefix_lm, "block_sparse": _block_sparse, "chunked": _chunked}


def _alibi_bias(slopes, t, s):
  """[1, N, T, S]: ALiBi's slopes[h] * (kv_idx - q_idx)."""
  rel = (jnp.arange(s)[None, :] - jnp.arange(t)[:, None]).astype(jnp.float32)
  return slopes[None, :, None, None] * rel[None, None]


def _mod_visible(case: Case) -> np.ndarray:
  """[B, N, T, S]: every mask of the case, the built-ins and the mask_mod."""
  seg = case.segment_ids()
  seg = None if seg is None else np.asarray(seg)
  ok = visible_mask(case.q_seq, case.kv_seq, is_causal=case.is_causal,
                    q_lengths=case.q_lengths, kv_lengths=case.kv_lengths, batch=case.batch,
                    q_segment_ids=seg, kv_segment_ids=seg)
  ok = np.broadcast_to(ok, (case.batch, case.q_heads, case.q_seq, case.kv_seq))
  if case.mask is not None:
    b, h, i, j = np.ix_(*(np.arange(n) for n in ok.shape))
    ok = ok & np.asarray(jax.vmap(MASK_MODS[case.mask])(
        *(jnp.broadcast_to(x, ok.shape).reshape(-1) for x in (b, h, i, j)))).reshape(ok.shape)
  return ok


def _attention_kwargs(case: Case, slopes):
  kwargs = dict(is_causal=case.is_causal, logits_soft_cap=case.soft_cap)
  if case.q_lengths is not None:
    kwargs["query_seq_lengths"] = jnp.asarray(case.q_lengths, jnp.int32)
  if case.kv_lengths is not None:
    kwargs["key_value_seq_lengths"] = jnp.asarray(case.kv_lengths, jnp.int32)
  seg = case.segment_ids()
  if seg is not None:
    kwargs.update(query_segment_ids=seg, key_value_segment_ids=seg)
  if case.alibi:
    def alibi(score, b, h, q_idx, kv_idx):
      return score + slopes[h] * (kv_idx - q_idx).astype(jnp.float32)
    kwargs["score_mod"] = alibi
  if case.mask is not None and case.block_mask:
    kwargs["block_mask"] = fa4_jax.create_block_mask(
        MASK_MODS[case.mask], None, case.q_heads, case.q_seq, case.kv_seq,
        q_block=64, kv_block=64)
  elif case.mask is not None:
    kwargs["mask_mod"] = MASK_MODS[case.mask]
  return kwargs


def _sm90_grads(case: Case, run_interpreted):
  """jax.grad of fa4_jax.attention(implementation="sm90") in the interpreter:
  (dq, dk, dv, d slopes)."""
  q, k, v, dout, slopes = case.inputs()

  def loss(q, k, v, slopes):
    out = fa4_jax.attention(q, k, v, implementation="sm90", **_attention_kwargs(case, slopes))
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

  return run_interpreted(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, slopes)


def _reference_grads(case: Case):
  """jax.grad of the f32 einsum attention with the explicit bias and mask."""
  q, k, v, dout, slopes = case.inputs()
  visible = jnp.asarray(_mod_visible(case))
  f32 = lambda x: x.astype(jnp.float32)

  def loss(q, k, v, slopes):
    bias = _alibi_bias(slopes, case.q_seq, case.kv_seq) if case.alibi else None
    out, _ = einsum_attention(q, k, v, visible, bias, 1 / math.sqrt(case.head_dim),
                              soft_cap=case.soft_cap)
    return jnp.sum(out * f32(dout))

  return jax.grad(loss, argnums=(0, 1, 2, 3))(f32(q), f32(k), f32(v), slopes)


def _check(case: Case, run_interpreted):
  got = _sm90_grads(case, run_interpreted)
  want = _reference_grads(case)
  q, k, v, _, _ = case.inputs()
  for name, g, x in zip(("dq", "dk", "dv"), got, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype, name
  names = ("dq", "dk", "dv", "dslopes") if case.alibi else ("dq", "dk", "dv")
  for name, g, w in zip(names, got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), name
    rel = relative_error(g, w)
    tol = 2e-2 if case.dtype == "bfloat16" else 5e-3
    if name == "dslopes":
      # A head's slope gradient is one sum of dS * (kv - q) over its scores,
      # terms of both signs, with delta from the bf16 output: the XLA path's
      # own bf16 gradient is 1.96 % off in "alibi_prefix_lm_causal_head_dim_128".
      tol *= 1.5
    assert rel < tol, (name, rel)
  return got


CASES = {
    # ALiBi on odd lengths (the slopes' gradient from backends' XLA pass).
    "alibi_causal_odd_lengths": Case(alibi=True, is_causal=True),
    "prefix_lm_mask_mod_fp16": Case(q_seq=136, kv_seq=136, mask="prefix_lm", dtype="float16",
                                   q_heads=1),
    # Block-sparse: EMPTY, FULL and PARTIAL tiles, a row that sees no key,
    # per-head classes; from a reused block mask.
    "block_mask_block_sparse_per_head": Case(q_seq=200, kv_seq=256, mask="block_sparse",
                                             block_mask=True),
    "alibi_chunked_causal_lengths_gqa_soft_cap": Case(
        batch=2, q_seq=90, kv_seq=120, q_heads=2, kv_heads=1, alibi=True, mask="chunked",
        is_causal=True, q_lengths=(90, 61), kv_lengths=(117, 80), soft_cap=3.0),
    # Head dim 128 under a causal mask: delta computed in the dQ kernel.
    "alibi_prefix_lm_causal_head_dim_128": Case(head_dim=128, q_seq=80, kv_seq=80, q_heads=1,
                                                 alibi=True, mask="prefix_lm", is_causal=True),
    # Head dim 256: the head-split dK/dV kernel.
    "alibi_chunked_head_dim_256": Case(head_dim=256, q_seq=48, kv_seq=72, alibi=True,
                                       mask="chunked"),
    # Head dim 192: dK and dV in two passes.
    "prefix_lm_soft_cap_head_dim_192": Case(head_dim=192, q_seq=56, kv_seq=80, q_heads=1,
                                            mask="prefix_lm", soft_cap=2.0),
    # Packed rows: segment ids streamed beside the block lists.
    "alibi_prefix_lm_segment_ids": Case(q_seq=80, kv_seq=80, q_heads=1, alibi=True,
                                        mask="prefix_lm", segments=((44, 30),),
                                        is_causal=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_reference(name, run_interpreted):
  _check(CASES[name], run_interpreted)


def test_a_score_mod_alone_on_three_dq_consumers(monkeypatch, run_interpreted):
  """A call with a score_mod and no mask_mod may keep the plain call's three
  dQ consumers (192-row CTA tiles, `THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD`):
  its lists, made from 64-row tiles, nest with them. 200 rows: a second,
  partial CTA tile under a causal mask."""
  monkeypatch.setattr(sm90_backward, "THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD", True)
  config = sm90_backward.choose_mods_config(64, MaskSpec(right=0), 2, score_mod=True,
                                            mask_mod=False)
  assert config.dq.num_consumers == 3
  _check(Case(q_seq=200, kv_seq=200, alibi=True, is_causal=True, q_heads=2), run_interpreted)


@pytest.mark.parametrize("name", ["prefix_lm_mask_mod_fp16", "block_mask_block_sparse_per_head",
                                  "prefix_lm_soft_cap_head_dim_192"])
def test_a_mask_mod_alone_may_fold_lse_and_delta(name, monkeypatch, run_interpreted):
  """`FOLD_STATS_WITH_MASK_MOD_ALONE`: a call whose only mod is a mask_mod
  starts the dK/dV kernel's S^T and dP^T accumulators at -lse2 / c and
  -delta, as plain GQA causal calls do (a mask needs no raw S^T; with
  soft-cap, whose tanh does, delta alone is folded). The gradients stay the
  reference's."""
  monkeypatch.setattr(sm90_backward, "FOLD_STATS_WITH_MASK_MOD_ALONE", True)
  config = sm90_backward.choose_mods_config(64, MaskSpec(), score_mod=False, mask_mod=True)
  assert config.dkv.fold_stats
  _check(CASES[name], run_interpreted)


def test_backward_is_the_sm90_kernel_for_mods():
  case = CASES["alibi_chunked_causal_lengths_gqa_soft_cap"]
  q, k, v, _, slopes = case.inputs()
  with fa4_jax.interpret_mode():
    for kwargs in (_attention_kwargs(case, slopes),
                   dict(mask_mod=_prefix_lm), dict(score_mod=lambda s, b, h, i, j: s * 0.5)):
      assert fa4_jax.which_implementation(q, k, v, implementation="sm90", part="backward",
                                          **kwargs) == "sm90"


def _lists(mods: Scores, config, shape):
  """The block lists (counts, order) of both kernels for `mods`."""
  b, t, s, n = shape
  q_pad, kv_pad = -(-t // 8) * 8, -(-s // 8) * 8
  _, dkv, dq = sm90_backward._kernel_mods(mods, config, b, n, t, s, q_pad, kv_pad)  # noqa: SLF001
  return dkv[:2], dq[:2]


def test_block_lists_skip_empty_tiles_and_reuse_the_block_mask():
  """Every listed block has some visible pair and no unlisted one has; a
  block mask's lists equal those of its mask_mod evaluated anew."""
  t, s, n = 200, 256, 2
  config = sm90_backward.choose_mods_config(64, MaskSpec(), 1)
  block_mask = fa4_jax.create_block_mask(_block_sparse, None, n, t, s, q_block=64, kv_block=64)
  from_mod = Scores(mask_mod=block_mask.mask_mod)
  from_block_mask = Scores(mask_mod=block_mask.mask_mod, block_mask=block_mask)
  a = _lists(from_mod, config, (1, t, s, n))
  b = _lists(from_block_mask, config, (1, t, s, n))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  visible = np.asarray(_block_sparse(0, jnp.arange(n)[:, None, None], jnp.arange(t)[:, None],
                                     jnp.arange(s)))
  dkv_keys = config.dkv.num_consumers * config.dkv.block_kv
  dq_rows = config.dq.num_consumers * config.dq.block_q
  for (counts, order), rows, cols, keys_are_rows in (
      (a[0], config.dkv.block_q, dkv_keys, True), (a[1], dq_rows, config.dq.block_kv, False)):
    counts, order = np.asarray(counts)[0], np.asarray(order)[0]
    assert counts.shape[0] == n  # per-head lists
    seen_empty = False
    for h in range(n):
      for tile in range(counts.shape[1]):
        listed = set(order[h, tile, :counts[h, tile].sum()].tolist())
        for other in range(order.shape[-1]):
          qt, kt = (other, tile) if keys_are_rows else (tile, other)
          block = visible[h, qt * rows:(qt + 1) * rows, kt * cols:(kt + 1) * cols]
          assert block.any() == (other in listed), (h, tile, other)
          seen_empty |= block.size > 0 and not block.any()
    assert seen_empty  # the mask has tiles the kernels skip


def _cross_lower_mods(cross_lower, d, config, mask, group, packed: bool):
  """Cross-lowers the backward with an ALiBi score_mod and a mask_mod (and
  with `packed`, lengths and segment ids) at ragged lengths."""
  b, t, s, kv_heads = 2, 509, 389, 2
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
  q, kv = spec((b, t, kv_heads * group, d)), spec((b, s, kv_heads, d))
  table = jnp.zeros((kv_heads * group,), jnp.float32)
  score_mod, _ = mod_functions.trace(
      lambda x, b, h, i, j: x + table[h] * (j - i).astype(jnp.float32), "score_mod")
  mask_mod, _ = mod_functions.trace(_prefix_lm, "mask_mod")

  def f(q, k, v, o, lse, do, slopes, q_len, kv_len, q_ids, kv_ids):
    if not packed:
      q_len = kv_len = q_ids = kv_ids = None
    segment_ids = None if q_ids is None else (q_ids, kv_ids)
    mods = Scores(mask=mask, scale=0.125, score_mod=score_mod, mask_mod=mask_mod,
                  score_captured=(slopes,), q_lengths=q_len, kv_lengths=kv_len,
                  q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return sm90_backward.backward(q, k, v, o, lse, do, q_len, kv_len, score=ScoreFunction(0.125),
                                  mask=mask,
                                  config=config, segment_ids=segment_ids, mods=mods)

  return cross_lower(f, q, kv, kv, q, spec((b, kv_heads * group, t), jnp.float32), q,
                     spec((kv_heads * group,), jnp.float32), spec((b,), jnp.int32),
                     spec((b,), jnp.int32), spec((b, t), jnp.int32), spec((b, s), jnp.int32))


@pytest.mark.parametrize("d,config", sm90_backward.mods_configs(),
                         ids=lambda x: str(x) if isinstance(x, int) else "")
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_mods_configs_fit_smem_and_use_wgmma_and_tma(d, config, packed, cross_lower):
  mask = MaskSpec(right=0) if config.delta_in_dq else MaskSpec()
  lowered = _cross_lower_mods(cross_lower, d, config, mask, 2, packed)
  assert len(lowered.smem_bytes) == (3 if config.dkv.dk_dv == "two_passes" else 2)
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert lowered.has("cp.async.bulk.tensor")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_three_dq_consumers_with_a_score_mod_fit(d, causal, monkeypatch, cross_lower):
  """The configs of `THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD` (off by default,
  so not among `mods_configs`) fit as the others do."""
  monkeypatch.setattr(sm90_backward, "THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD", True)
  mask = MaskSpec(right=0) if causal else MaskSpec()
  config = sm90_backward.choose_mods_config(d, mask, 2, score_mod=True, mask_mod=False)
  assert config.dq.num_consumers == 3
  lowered = _cross_lower_mods(cross_lower, d, config, mask, 2, packed=False)
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")


@pytest.mark.parametrize("name", ["prefix_lm_mask_mod_fp16", "block_mask_block_sparse_per_head",
                                  "alibi_chunked_head_dim_256"])
def test_heavy_tiles_first(name, monkeypatch, run_interpreted):
  """`HEAVY_TILES_FIRST_WITH_MODS`: the CTAs of both kernels take their tiles
  in the order of `heavy_tiles_first` (longest block lists first; the
  head-split dK/dV kernel at 256 too). The gradients stay the reference's."""
  monkeypatch.setattr(sm90_backward, "HEAVY_TILES_FIRST_WITH_MODS", True)
  _check(CASES[name], run_interpreted)


def test_heavy_tiles_first_order():
  """Tiles with more listed blocks (summed over the heads) come first; ties
  keep the grid's order; every tile once per batch row."""
  from fa4_jax.kernels.backward_inputs import heavy_tiles_first
  counts = np.zeros((2, 2, 5, 2), np.int32)
  counts[0, 0, :, 1] = [1, 4, 2, 4, 0]  # batch 0: tiles 1 and 3 tie
  counts[0, 1, :, 0] = [0, 0, 3, 0, 0]  # head 1's partial blocks make tile 2 the heaviest
  counts[1, :, :, 1] = [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
  order = np.asarray(heavy_tiles_first(jnp.asarray(counts)))
  np.testing.assert_array_equal(order, [[2, 1, 3, 0, 4], [4, 3, 2, 1, 0]])


def test_a_mask_mod_on_three_dq_consumers(monkeypatch, run_interpreted):
  """`THREE_DQ_CONSUMERS_WITH_MASK_MOD` (with the tiles heavy first): a
  mask_mod call's dQ kernel on 192-row CTA tiles, whose lists are unions of
  the 64-row fine tiles'. 136 rows: one partial CTA tile."""
  monkeypatch.setattr(sm90_backward, "THREE_DQ_CONSUMERS_WITH_MASK_MOD", True)
  monkeypatch.setattr(sm90_backward, "HEAVY_TILES_FIRST_WITH_MODS", True)
  config = sm90_backward.choose_mods_config(64, MaskSpec(), score_mod=False, mask_mod=True)
  assert config.dq.num_consumers == 3
  _check(CASES["prefix_lm_mask_mod_fp16"], run_interpreted)
