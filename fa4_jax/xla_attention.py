"""The XLA path: exact blockwise attention with memory linear in sequence length.

This is the fallback on CPU, TPU and GPUs without a kernel, and the backward
for kernels that have no fused backward yet. It never materializes the
T x S logits: queries are processed one block at a time (`lax.map`), and for
each query block a loop walks only the key blocks the mask lets it see
(causal and windowed masks and segment ids skip whole blocks), keeping an online softmax
(running max `m`, running sum `l`, unnormalized output `acc`) in float32.

The backward recomputes probabilities from the saved log-sum-exp once per
visible (query block, key block) pair, walking key blocks in order: dK and dV
of a block are summed in its loop (over the query heads of a GQA group too),
while dQ and the bias gradient are carried whole in float32 and updated in a
fixed order, so gradients are deterministic without scatter-adds.

Layout inside this module: queries grouped by KV head,
q [B, T, K, G, D] with N = K * G query heads, k/v [B, S, K, D].
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from fa4_jax import scores
from fa4_jax.scores import MaskSpec, Scores, cdiv

Array = jax.Array

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
MAX_ACCELERATOR_BLOCK = 4096
ACCELERATOR_BLOCK_BYTES = 512 * 2**20


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Block sizes of the XLA path (memory per step ~ B * N * block_q * block_k)."""

  block_q: int
  block_k: int

  def fit(self, t: int, s: int) -> "Blocks":
    """Shrinks blocks for short sequences (no more padding than needed)."""
    round8 = lambda n: max(8, cdiv(n, 8) * 8)
    return Blocks(min(self.block_q, round8(t)), min(self.block_k, round8(s)))

  @classmethod
  def default(cls, batch_heads: int) -> "Blocks":
    """512 x 512 on CPUs; on accelerators, larger square blocks while one f32
    logits block (batch * heads * block_q * block_k) stays within
    `ACCELERATOR_BLOCK_BYTES`: each loop step costs fixed launch overhead there,
    so fewer, larger steps run faster (measured on an H200, see BENCHMARKS.md).
    """
    block_q, block_k = DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K  # read at call time (tests)
    if jax.default_backend() != "cpu":
      while (block_q < MAX_ACCELERATOR_BLOCK
             and 4 * batch_heads * (2 * block_q) * (2 * block_k) <= ACCELERATOR_BLOCK_BYTES):
        block_q, block_k = 2 * block_q, 2 * block_k
    return cls(block_q, block_k)


@dataclasses.dataclass
class _Problem:
  """Inputs padded to whole blocks, plus what every block needs to know."""

  q: Array  # [B, Tp, K, G, D]
  k: Array  # [B, Sp, K, D]
  v: Array  # [B, Sp, K, D]
  bias: Optional[Array]  # [Bb, Kb, Gb, Tb, Sb], each dim 1 or full (padded)
  mask: Optional[Array]  # same layout as bias, bool
  q_len: Array  # int32 [B]: rows at or past it output zeros
  kv_len: Array  # int32 [B]: keys at or past it are masked
  q_segments: Optional[Array]  # int32 [B, Tp]: segment ids (padded), or None
  kv_segments: Optional[Array]  # int32 [B, Sp]
  # Per block, the blocks its segment ids can meet, over the whole batch.
  q_block_segments: Optional[scores.TileRanges]  # query block -> key blocks
  k_block_segments: Optional[scores.TileRanges]  # key block -> query blocks
  # bool [nq, nk]: the block pairs `mask_mod` lets some pair of (any batch
  # row and head) see; None without a mask_mod.
  mod_blocks: Optional[Array]
  q_seq: int  # true query length
  kv_seq: int  # true key length
  scores: Scores
  blocks: Blocks

  @property
  def spec(self) -> MaskSpec:
    return self.scores.mask

  @property
  def scale(self) -> float:
    return self.scores.scale

  @property
  def score_function(self) -> scores.ScoreFunction:
    """The built-in modifications of the logits (`modify`, `modify_grad`)."""
    return self.scores.score_function

  def widened(self, x):
    """A block of q, k or v as the matmuls take it: float8 widened (exactly)
    to the query's dtype, or to bfloat16 when the query is float8 too."""
    if x.dtype not in scores.FP8_DTYPES:
      return x
    return x.astype(self.q.dtype if self.q.dtype not in scores.FP8_DTYPES else jnp.bfloat16)

  def descaled_logits(self, s):
    """Logits [B, K, G, bq, bk] times the float8 descales of q and k."""
    kh, g = self.q.shape[2], self.q.shape[3]
    if self.scores.q_descale is not None:
      s = s * self.scores.q_descale.reshape(1, kh, g, 1, 1)
    if self.scores.k_descale is not None:
      s = s * self.scores.k_descale.reshape(1, kh, 1, 1, 1)
    return s

  @property
  def num_q_blocks(self) -> int:
    return self.q.shape[1] // self.blocks.block_q

  @property
  def num_k_blocks(self) -> int:
    return self.k.shape[1] // self.blocks.block_k

  def q_rows(self, qb):
    return qb * self.blocks.block_q + jnp.arange(self.blocks.block_q)

  def k_cols(self, kb):
    return kb * self.blocks.block_k + jnp.arange(self.blocks.block_k)

  def key_blocks_for(self, qb):
    """Key blocks [lo, hi) the query block `qb` may see (mask, lengths and
    segment ids)."""
    return self._blocks_paired_with(
        qb, self.blocks.block_q, self.q_len, self.kv_len, self.q_block_segments,
        lambda spec, lo, hi, n: spec.key_block_range(lo, hi, n, self.blocks.block_k))

  def query_blocks_for(self, kb):
    """Query blocks [lo, hi) that may see key block `kb`."""
    return self._blocks_paired_with(
        kb, self.blocks.block_k, self.kv_len, self.q_len, self.k_block_segments,
        lambda spec, lo, hi, n: spec.query_block_range(lo, hi, n, self.blocks.block_q))

  def walk_key_blocks(self, qb, step, carry):
    """`step(kb, carry)` over the key blocks query block `qb` sees."""
    lo, hi = self.key_blocks_for(qb)
    mod_row = None if self.mod_blocks is None else self.mod_blocks[qb]
    return _walk(lo, hi, mod_row, step, carry)

  def query_block_walk(self, kb):
    """`walk(step, carry)`: `step(qb, carry)` over the query blocks that see
    key block `kb`."""
    lo, hi = self.query_blocks_for(kb)
    mod_col = None if self.mod_blocks is None else self.mod_blocks[:, kb]
    return lambda step, carry: _walk(lo, hi, mod_col, step, carry)

  def _blocks_paired_with(self, b, size, own_len, other_len, own_segments, block_range):
    """The other side's blocks [lo, hi) that block `b` (of `size` rows or
    keys, `own_len` of them) pairs with: `block_range(spec, lo, hi, other_len)`
    is the MaskSpec's range; an empty block pairs with none."""
    if self.spec.offset_from_lengths:  # each row its own band: their union
      own_hi = jnp.minimum((b + 1) * size, own_len)
      lo, hi = block_range(self.spec.at_lengths(self.q_len, self.kv_len), b * size, own_hi,
                           other_len)
      lo, hi = _union_over_rows(lo, jnp.where(own_hi > b * size, hi, lo))
      return _narrow(lo, hi, own_segments, b)
    own_hi = jnp.minimum((b + 1) * size, jnp.max(own_len))
    lo, hi = block_range(self.spec, b * size, own_hi, jnp.max(other_len))
    return _narrow(lo, jnp.where(own_hi > b * size, hi, lo), own_segments, b)

  def _slice_pair(self, x, qb, kb):
    """The [.., Tb, Sb] block of a broadcastable bias or mask array."""
    bq, bk = self.blocks.block_q, self.blocks.block_k
    if x.shape[-2] > 1:
      x = lax.dynamic_slice_in_dim(x, qb * bq, bq, axis=-2)
    if x.shape[-1] > 1:
      x = lax.dynamic_slice_in_dim(x, kb * bk, bk, axis=-1)
    return x

  def scaled_logits(self, q_blk, k_blk, qb, kb):
    """scale * q.k (+ bias) [B, K, G, bq, bk] in float32: what `score_mod`
    takes."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", self.widened(q_blk), self.widened(k_blk),
                   preferred_element_type=jnp.float32)
    s = self.descaled_logits(s * jnp.float32(self.scale))
    if self.bias is not None:
      s = s + self._slice_pair(self.bias, qb, kb).astype(jnp.float32)
    return s

  def _mod_indices(self, qb, kb):
    """(batch, head, q_idx, kv_idx) broadcasting against [B, K, G, bq, bk]."""
    b, kh, g = self.q.shape[0], self.q.shape[2], self.q.shape[3]
    batch = jnp.arange(b, dtype=jnp.int32)[:, None, None, None, None]
    head = (jnp.arange(kh, dtype=jnp.int32)[:, None] * g
            + jnp.arange(g, dtype=jnp.int32)[None, :])[None, :, :, None, None]
    rows = self.q_rows(qb).astype(jnp.int32)[:, None]
    cols = self.k_cols(kb).astype(jnp.int32)[None, :]
    return batch, head, rows, cols

  def modified(self, s, qb, kb, score_captured=None):
    """`score_mod` and the soft-cap applied to scaled logits `s`
    (`Scores.modified`); `score_captured` replaces the captured arrays (to
    differentiate in them)."""
    scores_ = self.scores
    if scores_.score_mod is None:
      return self.score_function.modify(s)
    if score_captured is not None:
      scores_ = scores_.replace(score_captured=tuple(score_captured))
    return scores_.modified(s, *self._mod_indices(qb, kb))

  def logits(self, q_blk, k_blk, qb, kb):
    """Scaled, biased, modified (score_mod, soft-cap), masked logits
    [B, K, G, bq, bk] in float32 (-inf = masked)."""
    s = self.modified(self.scaled_logits(q_blk, k_blk, qb, kb), qb, kb)
    return self.masked(s, qb, kb)

  def masked(self, s, qb, kb):
    """`s` at -inf where the call's mask hides the pair."""
    rows, cols = self.q_rows(qb), self.k_cols(kb)
    q_seg = kv_seg = None
    if self.q_segments is not None:
      q_seg = self.q_block(self.q_segments, qb)[:, :, None]
      kv_seg = self.k_block(self.kv_segments, kb)[:, None, :]
    q_len = self.q_len[:, None, None] if self.spec.offset_from_lengths else None
    visible = scores.visible(self.spec, rows[None, :, None], cols[None, None, :],
                             self.kv_len[:, None, None], q_seg, kv_seg, q_len=q_len)  # [B, bq, bk]
    visible = visible[:, None, None]  # [B, 1, 1, bq, bk]
    if self.mask is not None:
      visible = visible & self._slice_pair(self.mask, qb, kb)
    if self.scores.mask_mod is not None:
      visible = visible & self.scores.mod_keeps(*self._mod_indices(qb, kb))
    return jnp.where(visible, s, -jnp.inf)

  def q_block(self, x, qb):
    return lax.dynamic_slice_in_dim(x, qb * self.blocks.block_q, self.blocks.block_q, 1)

  def k_block(self, x, kb):
    return lax.dynamic_slice_in_dim(x, kb * self.blocks.block_k, self.blocks.block_k, 1)


def _walk(lo, hi, mod_blocks, step, carry):
  """`step` over blocks [lo, hi), only those `mod_blocks` (bool [n] or
  None: all) marks, in increasing order."""
  if mod_blocks is None:
    return lax.fori_loop(lo, hi, step, carry)
  index = jnp.arange(mod_blocks.shape[0], dtype=jnp.int32)
  walked = mod_blocks & (index >= lo) & (index < hi)
  order = jnp.argsort(~walked, stable=True).astype(jnp.int32)
  return lax.fori_loop(0, walked.sum(dtype=jnp.int32), lambda n, c: step(order[n], c), carry)


def _union_over_rows(lo, hi):
  """Per-row block ranges [lo, hi) ([B] each) -> the smallest range that
  holds every non-empty one (empty if all are)."""
  seen = hi > lo
  union_lo = jnp.min(jnp.where(seen, lo, jnp.iinfo(jnp.int32).max))
  union_hi = jnp.max(jnp.where(seen, hi, 0))
  return jnp.minimum(union_lo, union_hi), union_hi


def _narrow(lo, hi, segments: Optional[scores.TileRanges], block):
  """[lo, hi) narrowed to the blocks that block `block`'s segment ids can
  meet in some batch row (the XLA path computes the whole batch per step)."""
  if segments is None:
    return lo, hi
  return jnp.maximum(lo, segments.lo[block]), jnp.maximum(lo, jnp.minimum(hi, segments.hi[block]))


def _batch_union(ranges: scores.TileRanges) -> scores.TileRanges:
  """[B, tiles] ranges -> [tiles]: the hull of every batch row's (the XLA
  path computes the whole batch per step and masks every element)."""
  return scores.hull([scores.TileRanges(*(x[b] for x in (ranges.lo, ranges.hi, ranges.full_lo,
                                                         ranges.full_hi)))
                      for b in range(ranges.lo.shape[0])])


def _group(x: Array, num_kv_heads: int) -> Array:
  """[B, T, N, D] -> [B, T, K, G, D]."""
  b, t, n, d = x.shape
  return x.reshape(b, t, num_kv_heads, n // num_kv_heads, d)


def _group_pair_array(x: Optional[Array], num_kv_heads: int) -> Optional[Array]:
  """Bias/mask [Bb, Nb, Tb, Sb] -> [Bb, Kb, Gb, Tb, Sb] (Nb is 1 or N)."""
  if x is None:
    return None
  bb, nb, tb, sb = x.shape
  if nb == 1:
    return x.reshape(bb, 1, 1, tb, sb)
  return x.reshape(bb, num_kv_heads, nb // num_kv_heads, tb, sb)


def _pad_axis(x: Array, axis: int, size: int, value=0) -> Array:
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _pad_pair_array(x, tp, sp, value):
  if x is None:
    return None
  if x.shape[-2] > 1:
    x = _pad_axis(x, x.ndim - 2, tp, value)
  if x.shape[-1] > 1:
    x = _pad_axis(x, x.ndim - 1, sp, value)
  return x


def _problem(q, k, v, bias, mask, scores_: Scores, blocks):
  q_lengths, kv_lengths = scores_.q_lengths, scores_.kv_lengths
  q_segment_ids, kv_segment_ids = scores_.q_segment_ids, scores_.kv_segment_ids
  b, t, n, d = q.shape
  s, num_kv_heads = k.shape[1], k.shape[2]
  blocks = (blocks or Blocks.default(b * n)).fit(t, s)
  tp = cdiv(t, blocks.block_q) * blocks.block_q
  sp = cdiv(s, blocks.block_k) * blocks.block_k
  full = lambda n_: jnp.full((b,), n_, jnp.int32)
  q_len = full(t) if q_lengths is None else jnp.minimum(q_lengths.astype(jnp.int32), t)
  kv_len = full(s) if kv_lengths is None else jnp.minimum(kv_lengths.astype(jnp.int32), s)
  q_seg = kv_seg = q_block_segments = k_block_segments = None
  if q_segment_ids is not None:
    bq, bk = blocks.block_q, blocks.block_k
    q_block_segments = _batch_union(
        scores.segment_tile_ranges(q_segment_ids, kv_segment_ids, bq, bk))
    k_block_segments = _batch_union(
        scores.segment_tile_ranges(kv_segment_ids, q_segment_ids, bk, bq))
    # Padded rows are sliced off and padded keys lie past kv_len: any id does.
    q_seg = _pad_axis(q_segment_ids.astype(jnp.int32), 1, tp)
    kv_seg = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp)
  mod_blocks = None
  classes = scores_.mod_classes(b, n, t, s, blocks.block_q, blocks.block_k)
  if classes is not None:
    mod_blocks = (classes != scores.EMPTY).any(axis=(0, 1))
  return _Problem(
      q=_pad_axis(_group(q, num_kv_heads), 1, tp),
      k=_pad_axis(k, 1, sp),
      v=_pad_axis(v, 1, sp),
      bias=_pad_pair_array(_group_pair_array(bias, num_kv_heads), tp, sp, 0),
      mask=_pad_pair_array(_group_pair_array(mask, num_kv_heads), tp, sp, False),
      q_len=q_len, kv_len=kv_len, q_segments=q_seg, kv_segments=kv_seg,
      q_block_segments=q_block_segments, k_block_segments=k_block_segments,
      mod_blocks=mod_blocks, q_seq=t, kv_seq=s, scores=scores_, blocks=blocks)


def _row_valid(p: _Problem, qb):
  """[B, 1, 1, bq]: rows before the query length."""
  return (p.q_rows(qb)[None, :] < p.q_len[:, None])[:, None, None, :]


def forward(q, k, v, bias, mask, scores_: Scores, *, blocks: Blocks | None = None):
  """Attention forward. Returns (out [B,T,N,D] in q.dtype, lse f32 [B,N,T]).

  The sinks of `scores_` are added after the blocks (`scores.add_sinks`):
  the lse includes them."""
  p = _problem(q, k, v, bias, mask, scores_, blocks)
  bsz, _, kh, g, _ = p.q.shape
  dv = p.v.shape[-1]  # the output's head dim (the value's, which may differ from q's and k's)
  bq = p.blocks.block_q

  def one_query_block(qb):
    q_blk = p.q_block(p.q, qb)

    def step(kb, carry):
      m, l, acc = carry
      s = p.logits(q_blk, p.k_block(p.k, kb), qb, kb)
      m_new = jnp.maximum(m, s.max(axis=-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows seeing nothing yet
      probs = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      l = alpha * l + probs.sum(axis=-1)
      v_blk = p.widened(p.k_block(p.v, kb))
      pv = jnp.einsum("bkgqs,bskd->bkgqd", probs.astype(v_blk.dtype), v_blk,
                      preferred_element_type=jnp.float32)
      return m_new, l, alpha[..., None] * acc + pv

    stats_shape = (bsz, kh, g, bq)
    init = (jnp.full(stats_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (dv,), jnp.float32))
    m, l, acc = p.walk_key_blocks(qb, step, init)
    valid = (l > 0) & _row_valid(p, qb)
    out = jnp.where(valid[..., None], acc / jnp.where(valid, l, 1.0)[..., None], 0.0)
    if scores_.v_descale is not None:
      out = out * scores_.v_descale.reshape(1, kh, 1, 1, 1)
    lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
    return out.astype(scores_.out_dtype or q.dtype), lse

  out, lse = lax.map(one_query_block, jnp.arange(p.num_q_blocks))
  # out: [nq, B, K, G, bq, D] -> [B, T, N, D];  lse: [nq, B, K, G, bq] -> [B, N, T]
  nq = p.num_q_blocks
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(bsz, nq * bq, kh * g, dv)[:, :p.q_seq]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(bsz, kh * g, nq * bq)[:, :, :p.q_seq]
  if scores_.sinks is not None:
    out, lse = scores.add_sinks(out, lse, scores_.sinks, scores_.q_lengths)
  return out, lse


def tangent(q, k, v, bias, mask, scores_: Scores, out, lse, dq, dk, dv, dbias, dsinks,
            dcaptured=None, *, blocks: Blocks | None = None):
  """Forward-mode derivative (dout, dlse) of `forward`'s (out, lse) along the
  tangents (dq, dk, dv, dbias or None, dsinks or None, and `dcaptured`: of
  the score_mod's captured arrays, or None), from its out and lse.

  With P = exp(s - lse) and dS the logits' tangent (the scaled dq K^T +
  Q dk^T plus dbias, through score_mod and the soft-cap): dlse = rowsum(P *
  dS) (+ the sink's share times dsinks) and dout = P dV + (P * dS) V - dlse
  * out. One pass over the visible blocks, as in `forward`: memory linear in
  sequence length.
  """
  sums = tangent_sums(q, k, v, bias, mask, scores_, lse, dq, dk, dv, dbias, dcaptured,
                      blocks=blocks)
  return finish_tangent(*sums, out, lse, scores_.sinks, dsinks)


def _captured_tangents(scores_: Scores, dcaptured):
  """The tangents of the score_mod's captured arrays, zeros where None."""
  if dcaptured is None:
    dcaptured = (None,) * len(scores_.score_captured)
  return tuple(jnp.zeros(c.shape, c.dtype) if (t is None or t.dtype == jax.dtypes.float0)
               and jnp.issubdtype(c.dtype, jnp.inexact) else t
               for c, t in zip(scores_.score_captured, dcaptured))


def tangent_sums(q, k, v, bias, mask, scores_: Scores, lse, dq, dk, dv, dbias, dcaptured=None,
                 *, blocks: Blocks | None = None):
  """The key-block sums of `tangent`: (P dV + (P * dS) V f32 [B,T,N,D],
  rowsum(P * dS) f32 [B,N,T]). Both are sums over keys, with P from the
  final `lse`: the keys may be split into parts (the context-parallel ring)
  and the parts' sums added before `finish_tangent`."""
  p = _problem(q, k, v, bias, mask, scores_, blocks)
  bsz, tp, kh, g, _ = p.q.shape
  dv_dim = p.v.shape[-1]  # the output's head dim
  sp = p.k.shape[1]
  bq = p.blocks.block_q
  dq = _pad_axis(_group(dq, kh), 1, tp)
  dk, dv = _pad_axis(dk, 1, sp), _pad_axis(dv, 1, sp)
  dbias = _pad_pair_array(_group_pair_array(dbias, kh), tp, sp, 0)
  lse_safe = _pad_axis(jnp.where(lse == -jnp.inf, 0.0, lse).reshape(bsz, kh, g, p.q_seq), 3, tp)
  captured = scores_.score_captured
  dcaptured = _captured_tangents(scores_, dcaptured)
  differentiable = [jnp.issubdtype(c.dtype, jnp.inexact) for c in captured]

  def one_query_block(qb):
    q_blk, dq_blk = p.q_block(p.q, qb), p.q_block(dq, qb)
    row_lse = lax.dynamic_slice_in_dim(lse_safe, qb * bq, bq, axis=3)[..., None]

    def step(kb, carry):
      d_out, d_lse = carry
      k_blk, v_blk = p.k_block(p.k, kb), p.k_block(p.v, kb)
      ds = (jnp.einsum("bqkgd,bskd->bkgqs", dq_blk, k_blk, preferred_element_type=jnp.float32)
            + jnp.einsum("bqkgd,bskd->bkgqs", q_blk, p.k_block(dk, kb),
                         preferred_element_type=jnp.float32)) * jnp.float32(p.scale)
      if dbias is not None:
        ds = ds + p._slice_pair(dbias, qb, kb).astype(jnp.float32)
      s0 = p.scaled_logits(q_blk, k_blk, qb, kb)
      if p.scores.score_mod is None:
        s = p.masked(p.modified(s0, qb, kb), qb, kb)
        ds = ds * p.score_function.modify_grad(s)
      else:  # through score_mod (in the logits and its captured arrays) and the soft-cap
        floats = [c for c, ok in zip(captured, differentiable) if ok]
        float_ts = [t for t, ok in zip(dcaptured, differentiable) if ok]

        def modified(s_, *floats_):
          it = iter(floats_)
          full = [next(it) if ok else c for c, ok in zip(captured, differentiable)]
          return p.modified(s_, qb, kb, full)

        s_mod, ds = jax.jvp(modified, (s0, *floats), (ds, *float_ts))
        s = p.masked(s_mod, qb, kb)
        ds = jnp.where(jnp.isfinite(s), ds, 0.0)
      probs = jnp.exp(s - row_lse)  # masked: exp(-inf) = 0
      pds = probs * ds
      d_out = d_out + jnp.einsum("bkgqs,bskd->bkgqd", pds.astype(p.v.dtype), v_blk,
                                 preferred_element_type=jnp.float32)
      d_out = d_out + jnp.einsum("bkgqs,bskd->bkgqd", probs.astype(p.v.dtype),
                                 p.k_block(dv, kb), preferred_element_type=jnp.float32)
      return d_out, d_lse + pds.sum(axis=-1)

    stats_shape = (bsz, kh, g, bq)
    init = (jnp.zeros(stats_shape + (dv_dim,), jnp.float32),
            jnp.zeros(stats_shape, jnp.float32))
    d_out, d_lse = p.walk_key_blocks(qb, step, init)
    valid = _row_valid(p, qb)  # rows past the query length are zeros in `forward`
    return jnp.where(valid[..., None], d_out, 0.0), jnp.where(valid, d_lse, 0.0)

  d_out, d_lse = lax.map(one_query_block, jnp.arange(p.num_q_blocks))
  nq = p.num_q_blocks
  d_out = d_out.transpose(1, 0, 4, 2, 3, 5).reshape(bsz, nq * bq, kh * g, dv_dim)[:, :p.q_seq]
  d_lse = d_lse.transpose(1, 2, 3, 0, 4).reshape(bsz, kh * g, nq * bq)[:, :, :p.q_seq]
  return d_out, d_lse


def finish_tangent(d_out, d_lse, out, lse, sinks, dsinks):
  """`tangent` from its key sums (`tangent_sums`): the sinks' share of the
  lse's tangent, and the output's change through the normalization."""
  if sinks is not None:
    d_lse = d_lse + scores.sink_probability(sinks, lse) * dsinks.astype(jnp.float32)[:, None]
  d_out = d_out - d_lse.transpose(0, 2, 1)[..., None] * out.astype(jnp.float32)
  return d_out.astype(out.dtype), d_lse


def backward(q, k, v, bias, mask, scores_: Scores, out, lse, dout, *,
             blocks: Blocks | None = None, dlse=None, captured_grads: bool = True):
  """Gradients (dq, dk, dv, dbias, dcaptured) of `forward`'s output, given
  its lse.

  `lse` may come from any backend that follows the contract in
  `fa4_jax/kernels/__init__.py`. `dbias` is None when `bias` is None, else it
  has the bias' own (broadcast) shape. `dcaptured`: the gradients of the
  score_mod's captured arrays (a tuple like them, None for integer ones), or
  None without a score_mod or with `captured_grads=False`. `dlse` [B, N, T]
  (or None) is a cotangent of the lse as well (only second-order reverse
  mode has one).
  """
  p = _problem(q, k, v, bias, mask, scores_, blocks)
  bsz, tp, kh, g, d = p.q.shape
  nh = kh * g
  scale = p.scale
  # Rows past the query length had their output forced to zero: no gradient.
  row_ok = jnp.arange(p.q_seq)[None, :] < p.q_len[:, None]  # [B, T]
  dout = jnp.where(row_ok[:, :, None, None], dout, 0).astype(dout.dtype)
  delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
  if dlse is not None:  # d lse / d s = P: it enters dS = P * (dP - delta) as -dlse
    delta = delta - dlse.astype(jnp.float32)
  do = _pad_axis(_group(dout, kh), 1, tp)

  def to_blocks(x):  # [B, N, T] -> [B, K, G, Tp] padded, for per-block slicing
    return _pad_axis(x.reshape(bsz, kh, g, p.q_seq), 3, tp)

  lse_safe = to_blocks(jnp.where(lse == -jnp.inf, 0.0, lse))
  delta = to_blocks(delta)
  bq, bk = p.blocks.block_q, p.blocks.block_k
  captured = scores_.score_captured
  with_mod = scores_.score_mod is not None
  float_idx = [i for i, c in enumerate(captured) if jnp.issubdtype(c.dtype, jnp.inexact)]
  if not captured_grads:
    float_idx = []

  def stats(x, qb):
    return lax.dynamic_slice_in_dim(x, qb * bq, bq, axis=3)[..., None]

  def probs_and_dlogits(qb, kb, q_blk, do_blk, k_blk, v_blk):
    """(P, dS with respect to scale * q.k + bias, the captured arrays'
    gradients from this block pair or None)."""
    dp_of = lambda: jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk,
                               preferred_element_type=jnp.float32)
    if not with_mod:
      s = p.logits(q_blk, k_blk, qb, kb)
      probs = jnp.exp(s - stats(lse_safe, qb))  # masked: exp(-inf) = 0
      ds = probs * (dp_of() - stats(delta, qb))
      if p.score_function.modifies_logits:
        ds = ds * p.score_function.modify_grad(s)  # through cap * tanh(. / cap)
      return probs, ds, None

    def modified(s_, *floats):
      full = list(captured)
      for i, c in zip(float_idx, floats):
        full[i] = c
      return p.modified(s_, qb, kb, full)

    dp = dp_of()
    s0 = p.scaled_logits(q_blk, k_blk, qb, kb)
    s_mod, pullback = jax.vjp(modified, s0, *(captured[i] for i in float_idx))
    s = p.masked(s_mod, qb, kb)
    probs = jnp.exp(s - stats(lse_safe, qb))
    ds_mod = jnp.where(jnp.isfinite(s), probs * (dp - stats(delta, qb)), 0.0)
    ds, *dfloats = pullback(ds_mod)
    return probs, jnp.where(jnp.isfinite(s), ds, 0.0), tuple(dfloats)

  # One pass over key blocks; for each, the query blocks that see it. dK and
  # dV of the block are summed in the loop (GQA groups included); dQ, the
  # bias gradient and the captured arrays' gradients are carried whole, in
  # f32, and added to in a fixed order, so the result is deterministic
  # without a second pass that would recompute the probabilities.
  def dkv_block(carry, kb):
    k_blk, v_blk = p.k_block(p.k, kb), p.k_block(p.v, kb)

    def step(qb, inner):
      dk, dv, dq_acc, dbias_acc, dcap_acc = inner
      q_blk, do_blk = p.q_block(p.q, qb), p.q_block(do, qb)
      probs, ds, dcap = probs_and_dlogits(qb, kb, q_blk, do_blk, k_blk, v_blk)
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", probs.astype(do.dtype), do_blk,
                           preferred_element_type=jnp.float32)
      ds_in = ds.astype(p.q.dtype)
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds_in, q_blk,
                           preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("bkgqs,bskd->bqkgd", ds_in, k_blk,
                          preferred_element_type=jnp.float32)
      dq_acc = lax.dynamic_update_slice_in_dim(
          dq_acc, p.q_block(dq_acc, qb) + dq_blk, qb * bq, axis=1)
      if dbias_acc is not None:
        dbias_acc = _accumulate_pair(dbias_acc, ds, qb * bq, kb * bk)
      if dcap:
        dcap_acc = tuple(a + x.astype(jnp.float32) for a, x in zip(dcap_acc, dcap))
      return dk, dv, dq_acc, dbias_acc, dcap_acc

    walk = p.query_block_walk(kb)
    zeros = lambda dim: jnp.zeros((bsz, bk, kh, dim), jnp.float32)
    dk, dv, *carry = walk(step, (zeros(d), zeros(p.v.shape[-1]), *carry))
    return tuple(carry), ((dk * scale).astype(k.dtype), dv.astype(v.dtype))

  dq0 = jnp.zeros(p.q.shape, jnp.float32)
  dbias0 = None if p.bias is None else jnp.zeros(p.bias.shape, jnp.float32)
  dcap0 = tuple(jnp.zeros(captured[i].shape, jnp.float32) for i in float_idx)
  (dq, dbias, dcap), (dk, dv) = lax.scan(dkv_block, (dq0, dbias0, dcap0),
                                         jnp.arange(p.num_k_blocks))
  dq = (dq * scale).astype(q.dtype).reshape(bsz, tp, nh, d)[:, :p.q_seq]
  unblock = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(bsz, -1, kh, x.shape[-1])[:, :p.kv_seq]
  dk, dv = unblock(dk), unblock(dv)

  if dbias is not None:
    dbias = dbias[..., :bias.shape[-2], :bias.shape[-1]]
    dbias = dbias.reshape(bias.shape).astype(bias.dtype)
  dcaptured = None
  if with_mod and captured_grads:
    dcaptured = [None] * len(captured)
    for i, g_ in zip(float_idx, dcap):
      dcaptured[i] = g_.astype(captured[i].dtype)
    dcaptured = tuple(dcaptured)
  return dq, dk, dv, dbias, dcaptured


def _accumulate_pair(acc, ds, q_lo, k_lo):
  """Adds logits gradients [B, K, G, bq, bk] into a broadcast bias gradient."""
  reduce_axes = tuple(i for i in range(3) if acc.shape[i] == 1 and ds.shape[i] > 1)
  ds = ds.sum(axis=reduce_axes, keepdims=True)
  if acc.shape[-2] == 1:
    ds = ds.sum(axis=-2, keepdims=True)
    q_lo = 0
  if acc.shape[-1] == 1:
    ds = ds.sum(axis=-1, keepdims=True)
    k_lo = 0
  start = (0, 0, 0, q_lo, k_lo)
  current = lax.dynamic_slice(acc, start, ds.shape)
  return lax.dynamic_update_slice(acc, current + ds, start)
