"""The Blackwell (sm_100) kernels with programmable scores (`score_mod`,
`mask_mod`, block masks: `forward(..., mods=)`), on the CPU.

* Numerics and barrier protocol: the kernels run in Pallas' GPU interpreter
  with race detection (TMEM, tcgen05 MMAs and barriers simulated), at small
  and odd shapes, against an independent f32 reference: the score_mod
  written out as an explicit bias and the mask_mod as an explicit boolean
  mask (numpy), through `reference.einsum_attention` or
  jax.nn.dot_product_attention(implementation="xla"). Rows that see no key
  give zeros and lse -inf. Tolerances: P is rounded to bf16 before P V
  (2e-2 on outputs); the lse stays f32 (1e-3).
* Tile skipping: FULL tiles run without `mask_mod` (a block mask claiming
  FULL where `mask_mod` hides everything gives dense attention) and EMPTY
  tiles are never loaded (NaN keys there do not reach the output).
* Hardware fit: the kernel with mods cross-lowers for sm_100 at every head
  dim it takes (tcgen05, TMEM, within SMEM).
* Gradients: jax.grad of `fa4_jax.attention(..., implementation="sm100")`
  (the sm100 forward, then the sm100 backward kernels, interpreted) against
  jax.grad of the f32 einsum reference: dq, dk, dv and the captured table's
  gradient (one XLA pass in `backends`), by relative error (2e-2).
* The public path: both sm100 kernels serve calls with mods, and an op the
  kernel cannot lower is a ValueError naming it (implementation=None then
  falls back to the XLA path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import mod_functions, scores
from fa4_jax.kernels import sm100_forward, sm100_tiles
from fa4_jax.scores import BlockMask, MaskSpec, ScoreFunction, Scores
from reference import einsum_attention

SCALE = 0.125
HEADS = 4
SLOPES = np.asarray([2.0 ** -(i + 1) for i in range(HEADS)], np.float32)
NUM_BUCKETS = 8  # a chain of 8 selects per element: short to interpret
TABLE = np.asarray(np.random.default_rng(1).normal(size=(HEADS, NUM_BUCKETS)), np.float32)


def alibi(score, b, h, q_idx, kv_idx):
  return score - jnp.asarray(SLOPES)[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


def alibi_bias(t, s):
  """[1, HEADS, t, s]: `alibi` written out."""
  distance = np.abs(np.arange(t)[:, None] - np.arange(s)[None, :])
  return -(SLOPES[:, None, None] * distance)[None]


def bucket(q_idx, kv_idx):
  return jnp.clip(kv_idx - q_idx + NUM_BUCKETS // 2, 0, NUM_BUCKETS - 1)


def table_bias(t, s, table=TABLE):
  """[1, HEADS, t, s]: `score + table[h, bucket(q, kv)]` written out."""
  buckets = np.clip(np.arange(s)[None, :] - np.arange(t)[:, None] + NUM_BUCKETS // 2, 0,
                    NUM_BUCKETS - 1)
  return np.asarray(table)[:, buckets][None]


def prefix_lm(prefix_lengths):
  """Row b's first prefix_lengths[b] keys are seen by every query, the rest
  causally: a per-batch captured array read by scalar. (mask_mod, keep
  [B, 1, t, s])."""
  prefix = jnp.asarray(prefix_lengths, jnp.int32)
  fn = lambda b, h, q_idx, kv_idx: (kv_idx < prefix[b]) | (kv_idx <= q_idx)
  keep = lambda t, s: ((np.arange(s)[None, None, None, :]
                        < np.asarray(prefix_lengths)[:, None, None, None])
                       | (np.arange(s)[None, :] <= np.arange(t)[:, None])[None, None])
  return fn, keep


def chunked(chunk):
  fn = lambda b, h, q_idx, kv_idx: (q_idx // chunk) == (kv_idx // chunk)
  keep = lambda t, s: ((np.arange(t)[:, None] // chunk)
                       == (np.arange(s)[None, :] // chunk))[None, None]
  return fn, keep


def scores_value(score_fn=None, mask_fn=None, **changes) -> Scores:
  """The kernels' `mods=` argument: the traced functions and their arrays."""
  sm, sc = mod_functions.trace(score_fn, "score_mod") if score_fn else (None, ())
  mm, mc = mod_functions.trace(mask_fn, "mask_mod") if mask_fn else (None, ())
  return Scores(score_mod=sm, mask_mod=mm, score_captured=sc, mask_captured=mc, **changes)


def inputs(b, t, s, n, nkv, d, dtype=jnp.bfloat16, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, d), dtype)
  k = jax.random.normal(keys[1], (b, s, nkv, d), dtype)
  v = 1.0 + jax.random.normal(keys[2], (b, s, nkv, d), dtype)  # "wrong keys" shows
  return q, k, v


def assert_matches(out, lse, ref_out, ref_lse, visible):
  """Rows that see a key against the reference; the others zeros, lse -inf."""
  b, t, n, _ = out.shape
  rows = np.broadcast_to(np.asarray(visible).any(-1), (b, n, t))  # [B, N, T]
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  rows_btn = rows.transpose(0, 2, 1)
  np.testing.assert_allclose(out[rows_btn], np.asarray(ref_out)[rows_btn], atol=2e-2, rtol=2e-2)
  np.testing.assert_array_equal(out[~rows_btn], 0.0)
  np.testing.assert_allclose(lse[rows], np.asarray(ref_lse)[rows], atol=1e-3, rtol=1e-4)
  assert np.all(lse[~rows] == -np.inf)


# --- the forward kernel, interpreted ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ForwardCase:
  batch: int = 1
  q_seq: int = 200
  kv_seq: int = 333
  kv_heads: int = 2
  head_dim: int = 64
  causal: bool = False
  score: str | None = None  # "alibi" | "table"
  keep: str | None = None  # "prefix" | "chunked"
  q_lengths: tuple | None = None
  kv_lengths: tuple | None = None
  soft_cap: float | None = None
  persistent: bool = False
  documents: tuple | None = None  # packed documents' lengths (segment ids), T == S

  def segment_ids(self):
    """int32 [B, T]: each position's document, or None."""
    if self.documents is None:
      return None
    return np.repeat(np.arange(len(self.documents)), self.documents)[None].repeat(self.batch, 0)


FORWARD_CASES = {
    # Prefix-LM per batch row with key and query lengths: lists per batch row.
    "prefix_lm_lengths": ForwardCase(keep="prefix", batch=2, q_seq=130, kv_seq=200,
                                     q_lengths=(130, 77), kv_lengths=(150, 200)),
    # Chunked local attention with ALiBi and soft-cap (bf16: the fixed max),
    # D256 (64-key blocks, one Q tile per CTA): off-chunk tiles EMPTY.
    "chunked_alibi_soft_cap_d256": ForwardCase(score="alibi", keep="chunked", head_dim=256,
                                               q_seq=256, kv_seq=320, soft_cap=20.0),
    # A per-element lookup in a captured [H, 8] table (a chain of selects),
    # D128, odd lengths, on the persistent grid (each work item's list).
    "persistent_chunked_table_d128": ForwardCase(score="table", keep="chunked", head_dim=128,
                                                 q_seq=300, kv_seq=350, causal=True,
                                                 persistent=True),
    # ALiBi, causal, GQA, packed documents: the lists hold the ids' tile
    # ranges, the element mask the ids.
    "segment_ids_alibi_causal_gqa": ForwardCase(score="alibi", causal=True, q_seq=256,
                                                kv_seq=256, documents=(100, 90, 66)),
}


def _mods_and_reference(case: ForwardCase):
  """(score_mod, bias [1, N, T, S] or None, mask_mod, keep [B|1, 1, T, S] or None)."""
  score_fn = bias = mask_fn = keep = None
  t, s = case.q_seq, case.kv_seq
  if case.score == "alibi":
    score_fn, bias = alibi, alibi_bias(t, s)
  elif case.score == "table":
    table = jnp.asarray(TABLE)
    score_fn = lambda x, b, h, qi, ki: x + table[h, bucket(qi, ki)]
    bias = table_bias(t, s)
  if case.keep == "prefix":
    mask_fn, keep = prefix_lm([37, 150][:case.batch])
  elif case.keep == "chunked":
    mask_fn, keep = chunked(96)
  return score_fn, bias, mask_fn, None if keep is None else keep(t, s)


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_forward_with_mods_matches_the_einsum_reference_without_races(name, run_interpreted):
  case = FORWARD_CASES[name]
  q, k, v = inputs(case.batch, case.q_seq, case.kv_seq, HEADS, case.kv_heads, case.head_dim)
  score_fn, bias, mask_fn, keep = _mods_and_reference(case)
  mods = scores_value(score_fn, mask_fn)
  as_array = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
  q_len, kv_len = as_array(case.q_lengths), as_array(case.kv_lengths)
  mask = MaskSpec.from_arguments(case.causal, None)
  config = None
  if case.persistent:
    config = dataclasses.replace(sm100_forward.choose_config(case.head_dim, jnp.bfloat16),
                                 persistent=True, num_sms=3)
  ids = case.segment_ids()
  segment_ids = None if ids is None else (jnp.asarray(ids), jnp.asarray(ids))
  out, lse = run_interpreted(lambda q, k, v: sm100_forward.forward(
      q, k, v, q_len, kv_len, score=ScoreFunction(SCALE, case.soft_cap), mask=mask, config=config,
      segment_ids=segment_ids, mods=mods), q, k, v)

  t, s = case.q_seq, case.kv_seq
  rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
  visible = np.ones((case.batch, 1, t, s), bool)
  if case.causal:
    visible &= cols <= rows
  if case.q_lengths is not None:
    visible &= rows < np.asarray(case.q_lengths)[:, None, None, None]
  if case.kv_lengths is not None:
    visible &= cols < np.asarray(case.kv_lengths)[:, None, None, None]
  if keep is not None:
    visible &= keep
  if ids is not None:
    visible &= (ids[:, :, None] == ids[:, None, :])[:, None]
  ref_out, ref_lse = einsum_attention(q, k, v, visible, scale=SCALE, soft_cap=case.soft_cap,
                                      bias=None if bias is None else jnp.asarray(bias))
  assert_matches(out, lse, ref_out, ref_lse, visible)


def test_forward_skips_mask_mod_on_full_tiles_and_never_loads_empty_ones(run_interpreted):
  """A block mask (tiles of 256 x 128, the CTA's) claims FULL where
  `mask_mod` would hide every key, and EMPTY for the last key tile, whose
  keys and values are NaN: the output is dense attention over the first
  two key tiles, finite. Evaluating mask_mod on a FULL tile would zero it;
  loading the EMPTY tile would spread NaN."""
  t, s = 256, 384
  hide_all = lambda b, h, q_idx, kv_idx: q_idx < 0
  mod, captured = mod_functions.trace(hide_all, "mask_mod")
  classes = np.asarray([[[[scores.FULL, scores.FULL, scores.EMPTY]]]], np.int8)
  block_mask = BlockMask(classes=jnp.asarray(classes), mask_captured=captured, q_len=t,
                         kv_len=s, mask_mod=mod, q_block=256, kv_block=128)
  mods = Scores(mask_mod=mod, mask_captured=captured, block_mask=block_mask)
  q, k, v = inputs(1, t, s, 2, 2, 64)
  k, v = k.at[:, 256:].set(jnp.nan), v.at[:, 256:].set(jnp.nan)
  out, lse = run_interpreted(lambda q, k, v: sm100_forward.forward(
      q, k, v, None, None, score=ScoreFunction(SCALE), mask=MaskSpec(), mods=mods), q, k, v)
  visible = np.zeros((1, 1, t, s), bool)
  visible[..., :256] = True
  ref_out, ref_lse = einsum_attention(q, jnp.nan_to_num(k), jnp.nan_to_num(v), visible,
                                      scale=SCALE)
  assert_matches(out, lse, ref_out, ref_lse, visible)


def test_the_mods_see_the_global_batch_and_head_through_the_index_offsets(run_interpreted):
  """A sharded call's offsets (`Scores.index_offsets`) are added to the
  batch and head the mods see."""
  t, s = 128, 200
  q, k, v = inputs(1, t, s, 2, 2, 64)
  per_head = jnp.asarray([0.0, 0.0, 0.0, 1.0, -1.0], jnp.float32)  # global heads 3, 4
  per_batch = jnp.asarray([5, 5, 140], jnp.int32)  # global batch row 2: 140 keys
  mods = scores_value(lambda x, b, h, qi, ki: x + per_head[h] * ki.astype(jnp.float32) / 64,
                      lambda b, h, qi, ki: ki < per_batch[b],
                      index_offsets=jnp.asarray([2, 3], jnp.int32))
  out, lse = run_interpreted(lambda q, k, v: sm100_forward.forward(
      q, k, v, None, None, score=ScoreFunction(SCALE), mask=MaskSpec(), mods=mods), q, k, v)
  bias = (np.asarray([1.0, -1.0])[:, None, None] * np.arange(s)[None, None, :] / 64)[None]
  visible = np.broadcast_to(np.arange(s) < 140, (t, s))[None, None]
  ref_out, ref_lse = einsum_attention(q, k, v, visible, bias=jnp.asarray(bias, jnp.float32),
                                      scale=SCALE)
  assert_matches(out, lse, ref_out, ref_lse, visible)


# --- cross-lowering for sm_100 ----------------------------------------------------


@pytest.mark.parametrize("head_dim", [128, 256])  # 64 tiles as 128 does
def test_forward_with_mods_cross_lowers_for_sm100(head_dim, cross_lower):
  """ALiBi, a per-element table lookup and a per-batch prefix mask_mod
  lower in the TMEM row layout, beside segment ids and lengths, with
  tcgen05 MMAs and within SMEM."""
  table = jnp.asarray(TABLE)
  prefix_fn, _ = prefix_lm([100, 300])
  mods = scores_value(lambda x, b, h, qi, ki: alibi(x, b, h, qi, ki) + table[h, bucket(qi, ki)],
                      prefix_fn)
  q_spec = jax.ShapeDtypeStruct((2, 1000, HEADS, head_dim), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((2, 1030, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  ids = (jax.ShapeDtypeStruct((2, 1000), jnp.int32), jax.ShapeDtypeStruct((2, 1030), jnp.int32))
  lowered = cross_lower(
      lambda q, k, v, a, b, qi, ki: sm100_forward.forward(
          q, k, v, a, b, score=ScoreFunction(SCALE), mask=MaskSpec(right=0),
          segment_ids=(qi, ki), mods=mods),
      q_spec, kv_spec, kv_spec, lengths, lengths, *ids, arch="sm_100")
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st",
                      "cp.async.bulk.tensor", "mbarrier.try_wait.parity"):
    assert lowered.has(instruction), instruction
  assert 0 < lowered.max_smem_bytes <= sm100_tiles.SMEM_BYTES


# --- the public path ----------------------------------------------------------------


@pytest.mark.parametrize("score_mod, op", [
    (lambda s, b, h, q, kv: jnp.sin(s), "sin"),
    (lambda s, b, h, q, kv: jnp.fmod(s, 2.0), "rem on floats"),
])
def test_an_op_the_kernel_cannot_lower_is_a_value_error_naming_it(score_mod, op):
  """Asked for by name, the sm100 kernel refuses with the op's name; with
  implementation=None the call falls back to the XLA path."""
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with fa4_jax.interpret_mode():
    with pytest.raises(ValueError, match=op):
      fa4_jax.attention(q, q, q, score_mod=score_mod, implementation="sm100")
    with pytest.raises(ValueError, match=op):
      sm100_forward.forward(q, q, q, None, None, score=ScoreFunction(1.0), mask=MaskSpec(),
                            mods=scores_value(score_mod))
  with fa4_jax.gpu_target("sm100"):
    assert fa4_jax.which_implementation(q, q, q, score_mod=score_mod) == "xla"
    assert fa4_jax.which_implementation(q, q, q, score_mod=alibi) == "sm100"


# --- the backward kernels, interpreted (through the public path) ---------------------


@dataclasses.dataclass(frozen=True)
class BackwardCase:
  batch: int = 1
  q_seq: int = 100
  kv_seq: int = 150
  kv_heads: int = 2
  head_dim: int = 64
  dtype: str = "bfloat16"
  causal: bool = False
  score: str | None = None  # "alibi" | "table": the table's gradient is checked too
  keep: str | None = None  # "prefix" (as a reused block mask) | "chunked"
  q_lengths: tuple | None = None
  kv_lengths: tuple | None = None
  soft_cap: float | None = None


BACKWARD_CASES = {
    # A table score_mod with chunked local attention, causal, soft-cap (its
    # slope times score_mod's in dS), lengths, GQA (dK/dV summed over the
    # group's block lists), two batch rows: the table's gradient comes from
    # backends' XLA pass.
    "table_chunked_causal_soft_cap_lengths_gqa": BackwardCase(
        score="table", keep="chunked", causal=True, batch=2, q_seq=100, kv_seq=150,
        soft_cap=5.0, q_lengths=(100, 60), kv_lengths=(140, 150)),
    # ALiBi with prefix-LM from a create_block_mask block mask, fp16, D128.
    "alibi_prefix_block_mask_fp16_d128": BackwardCase(
        score="alibi", keep="prefix", head_dim=128, dtype="float16", q_seq=160, kv_seq=192),
}


def _backward_grads(case: BackwardCase, implementation: str, run=lambda f, *a: f(*a)):
  """(dq, dk, dv, d table) of sum(out * dout): `fa4_jax.attention` for a
  kernel, the f32 einsum attention with the explicit bias and mask for
  "reference"."""
  dtype = jnp.dtype(case.dtype)
  q, k, v = inputs(case.batch, case.q_seq, case.kv_seq, HEADS, case.kv_heads, case.head_dim,
                   dtype)
  dout = jax.random.normal(jax.random.key(9), q.shape, dtype)
  t, s = case.q_seq, case.kv_seq
  keep_fn, keep = {"prefix": prefix_lm([37, 150][:case.batch]), "chunked": chunked(64),
                   None: (None, lambda t, s: np.ones((1, 1, t, s), bool))}[case.keep]
  as_array = lambda x: None if x is None else jnp.asarray(x, jnp.int32)

  def loss_kernel(q, k, v, table):
    kwargs = dict(is_causal=case.causal, scale=SCALE, logits_soft_cap=case.soft_cap,
                  query_seq_lengths=as_array(case.q_lengths),
                  key_value_seq_lengths=as_array(case.kv_lengths))
    if case.score == "alibi":
      kwargs["score_mod"] = alibi
    elif case.score == "table":
      kwargs["score_mod"] = lambda x, b, h, qi, ki: x + table[h, bucket(qi, ki)]
    if case.keep == "prefix":
      kwargs["block_mask"] = fa4_jax.create_block_mask(keep_fn, case.batch, None, t, s)
    elif case.keep is not None:
      kwargs["mask_mod"] = keep_fn
    out = fa4_jax.attention(q, k, v, implementation=implementation, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

  def loss_reference(q, k, v, table):
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    visible = np.ones((case.batch, 1, t, s), bool) & keep(t, s)
    if case.causal:
      visible &= cols <= rows
    if case.q_lengths is not None:
      visible &= rows < np.asarray(case.q_lengths)[:, None, None, None]
    if case.kv_lengths is not None:
      visible &= cols < np.asarray(case.kv_lengths)[:, None, None, None]
    bias = {"alibi": lambda: jnp.asarray(alibi_bias(t, s)),
            "table": lambda: table[:, np.clip(cols - rows + NUM_BUCKETS // 2, 0,
                                              NUM_BUCKETS - 1)][None],
            None: lambda: None}[case.score]()
    out, _ = einsum_attention(q, k, v, visible, bias, SCALE, soft_cap=case.soft_cap)
    return jnp.sum(out * dout.astype(jnp.float32))

  grad = jax.grad(loss_reference if implementation == "reference" else loss_kernel,
                  argnums=(0, 1, 2, 3))
  if implementation == "reference":
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  return run(grad, q, k, v, jnp.asarray(TABLE))


@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_backward_with_mods_matches_the_einsum_reference_without_races(name, run_interpreted):
  case = BACKWARD_CASES[name]
  with fa4_jax.interpret_mode():
    kernel_grads = _backward_grads(case, "sm100", run_interpreted)
  want = _backward_grads(case, "reference")
  names = ("dq", "dk", "dv", "dtable") if case.score == "table" else ("dq", "dk", "dv")
  for name, got, ref in zip(names, kernel_grads, want):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), name
    error = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert error < 2e-2, (name, error)


def test_calls_with_mods_are_served_by_the_sm100_kernels_forward_and_backward():
  """The public path (`fa4_jax.attention`, which the backward cases above
  differentiate) runs both sm100 kernels for a call with mods."""
  q = jnp.zeros((1, 128, HEADS, 64), jnp.bfloat16)
  k = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  mask_fn, _ = chunked(64)
  with fa4_jax.interpret_mode():
    for kwargs in (dict(score_mod=alibi), dict(mask_mod=mask_fn),
                   dict(score_mod=alibi, mask_mod=mask_fn)):
      for part in ("forward", "backward"):
        assert fa4_jax.which_implementation(q, k, k, implementation="sm100", part=part,
                                            **kwargs) == "sm100", (kwargs, part)


@pytest.mark.parametrize("head_dim", [128])  # 64 takes the same blocks
def test_backward_with_mods_cross_lowers_for_sm100(head_dim, cross_lower):
  """Both backward kernels with a table score_mod (its slope in dS) and a
  per-batch prefix mask_mod, beside lengths, segment ids and GQA, lower for sm_100
  (tcgen05, TMEM) within SMEM."""
  from fa4_jax.kernels import sm100_backward
  table = jnp.asarray(TABLE)
  prefix_fn, _ = prefix_lm([100, 300])
  mods = scores_value(lambda x, b, h, qi, ki: x + table[h, bucket(qi, ki)], prefix_fn)
  q = jax.ShapeDtypeStruct((2, 1000, HEADS, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1030, 2, head_dim), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, HEADS, 1000), jnp.float32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  ids = (jax.ShapeDtypeStruct((2, 1000), jnp.int32), jax.ShapeDtypeStruct((2, 1030), jnp.int32))
  lowered = cross_lower(
      lambda q, k, v, o, lse, do, a, b, qi, ki: sm100_backward.backward(
          q, k, v, o, lse, do, a, b, score=ScoreFunction(SCALE), mask=MaskSpec(right=0),
          segment_ids=(qi, ki), mods=mods),
      q, kv, kv, q, lse, q, lengths, lengths, *ids, arch="sm_100")
  assert len(lowered.modules) == 2  # dK/dV and dQ
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st",
                      "cp.async.bulk.tensor"):
    assert lowered.has(instruction), instruction
  assert 0 < lowered.max_smem_bytes <= sm100_tiles.SMEM_BYTES
