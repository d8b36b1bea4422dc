"""What every kernel with programmable scores (`score_mod`, `mask_mod`, block
masks) shares, whatever its architecture or register layout.

With mods a kernel walks block lists instead of tile ranges: per CTA tile,
the other side's blocks in the order `scores.block_lists` gives (PARTIAL
ones, with the element mask, then FULL ones, without it; EMPTY ones are
never loaded). The lists come as GMEM operands (`backward_inputs.mod_operands`:
`ModRefs`), so do the mods' captured arrays; the traced functions are
static (`ModStatics`). Before its walk a kernel binds the mods to the
(batch, head) of its tile (`ModRefs.on_rows`: `TileMods`), so that their
reads of captured arrays happen once per tile, not once per block.

Layout-specific work (the iotas of a tile's positions, the element mask)
stays in the kernels: `sm90_tiles.where_visible` (WGMMA layout),
`sm100_tiles.element_mask` (TMEM rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

from fa4_jax import mod_functions, scores


def bound_mask_hook(bound):
  """An element mask's `mask_mod` hook (q_idx, kv_idx) -> bool tile for a
  `mod_functions.BoundMod` (a mask_mod bound to its tile's batch and head
  before the kernel's loop over key blocks); None for None."""
  if bound is None:
    return None

  def hook(q_idx, kv_idx):
    keep = bound(q_idx, kv_idx)
    return jnp.broadcast_to(keep, q_idx.shape) if jnp.shape(keep) != q_idx.shape else keep

  return hook


def check_mods(kernel: str, mods) -> None:
  """Raises `mod_functions.Unsupported` (a ValueError) naming the op when a
  kernel cannot run the mods of `mods` (a `scores.Scores`) on a tile
  (`mod_functions.kernel_problem`)."""
  for mod in (mods.score_mod, mods.mask_mod):
    if mod is not None:
      problem = mod_functions.kernel_problem(mod)
      if problem is not None:
        raise mod_functions.Unsupported(f"{kernel}: {problem}")


def kernel_score_function(score: scores.ScoreFunction, score_mod,
                          decode_group: int | None = None) -> scores.ScoreFunction:
  """How the sm90 kernels form the logits of a call with `score_mod` (a
  `mod_functions.ModFunction` or None) and `score`: where the mod is
  a * x + R(q_idx) + C(kv_idx) with a fixed a (`mod_functions.affine_form`;
  `decode_group`: in the decode arrangement's rows) a joins the scale, and
  without C and soft-cap the logits are the raw scores, as without a mod
  (`ScoreFunction.with_affine_score_mod`). The forward and the backward
  both take it, so the lse one saves is what the other reads."""
  if score_mod is None:
    return score.with_score_mod(False)
  form = mod_functions.affine_form(score_mod, decode_group)
  if form is None or form.factor is None:
    return score.with_score_mod(True)
  return score.with_affine_score_mod(form.factor, per_score=form.key_terms)


def affine_logits(score_fn, s, q_idx, kv_idx, *, score: scores.ScoreFunction, scale,
                  query_axis: int, with_slope: bool = False):
  """(t, row_offset, slope) of a raw Q K^T tile `s` under a score_mod that
  `mod_functions.affine_form` found to be a * x + R(q_idx) + C(kv_idx)
  (`score_fn`, a `mod_functions.BoundMod`), for a kernel whose `score` is
  `kernel_score_function`'s. The queries lie along tile axis `query_axis`
  (1 in the kernels that own keys); `q_idx`, `kv_idx`: the tile's
  positions (`mod_functions.Positions`). `scale`: the raw scores' factor
  (`score.scale`, times a float8 descale).

  t: the softmax's logits: s itself where `score` keeps the scale (and a)
  in its exp2 constant (the mod has no C, no soft-cap), else
  s * (scale * a) + C, one FMA per score; with soft-cap R joins it there
  and t is soft-capped (`ScoreFunction.modified_logits`).
  row_offset: R and the mod's constant in log2 units (times log2(e)),
  which the softmax adds to c * t of each query (the forward's running
  max, the backward's lse: ops per query, not per score): a vector along
  `query_axis`, a scalar, or None (nothing, or inside t).
  slope: dt/dx, x the scaled score the mod sees, where it is not 1 (with
  `with_slope`, for dS): an a read per tile, times the soft-cap's slope."""
  # R in log2 units, as the softmax's statistics are; with soft-cap it joins t.
  rest_scale = scores.LOG2_E if score.cap is None else 1.0
  factor, key, rest = score_fn.affine_parts(q_idx, kv_idx, query_axis, rest_scale)
  slope = None
  if not score.has_score_mod:  # a and the scale are in c; there is no C
    t = s
  else:
    fixed = mod_functions.is_number(factor)  # (and then in `score.scale`)
    multiplier = scale if fixed else scale * factor
    t = s * (jnp.float32(multiplier) if isinstance(multiplier, float) else multiplier)
    if key is not None:
      t = t + key.tile()
    if score.cap is not None:
      if rest is not None:
        t = t + (rest.tile() if isinstance(rest, mod_functions.Along) else rest)
        rest = None
      t = score.modified_logits(t)
    if with_slope and not fixed:
      slope = factor
  if with_slope:
    builtin = score.slope(t)
    if builtin is not None:
      slope = builtin if slope is None else slope * builtin
  if rest is None:
    return t, None, slope
  return t, rest.vector if isinstance(rest, mod_functions.Along) else rest, slope


def folds_affine(score_mod, score: scores.ScoreFunction) -> bool:
  """Whether a backward kernel can start its S (S^T) accumulator at the
  affine form's terms and lse2 (`affine_scores_init`): `score_mod` is
  a * x + R(q_idx) + C(kv_idx) with a fixed a (`mod_functions.affine_form`)
  and no soft-cap's tanh needs the raw scores."""
  if score_mod is None or score.cap is not None:
    return False
  form = mod_functions.affine_form(score_mod)
  return form is not None and form.factor is not None


def affine_scores_init(score_fn, q_idx, kv_idx, lse2, *, score: scores.ScoreFunction,
                       query_axis: int):
  """(V, k) such that P = exp2(k * (V + s)) for a raw Q K^T tile s under a
  score_mod that `folds_affine` admits, for a kernel whose `score` is
  `kernel_score_function`'s: a backward kernel starts its S (S^T) wgmma
  accumulator at V and forms P with one multiply a score.

  `affine_logits` gives t = s * m + C (m = scale * a; t = s, m = 1, where
  the mod has no C: the scale is then in c) and P = exp2(c t + R2 - lse2),
  R2 = R times log2(e) (with the mod's constant). So k = c m and
  V = C / m + (R2 - lse2) / k: a vector along the keys plus one along the
  queries (`query_axis`), one add per element. `lse2`: a vector along the
  queries (+inf on rows that see no key: V = +-inf, k * V = -inf, P = 0).

  Rounding: V + s is what the tensor core accumulates onto V. Where P is
  not negligible, k (V + s) = log2 P lies in [-~30, 0], so |V| <= |s| +
  30 / |k| even where C and R2 - lse2 are each large (ALiBi's slope times a
  distance): the accumulator holds a value of the size of the plain fold's
  (`DkvConfig.fold_stats`: -lse2 / c). The two vectors are rounded once
  each before the add (as t and lse2 - R are today): an error of about
  2 u (|c C| + |R2 - lse2|) in log2 P, u = 2^-24."""
  factor, key, rest = score_fn.affine_parts(q_idx, kv_idx, query_axis, scores.LOG2_E)
  assert mod_functions.is_number(factor) and score.cap is None, "not an affine fold"
  m = score.scale if score.has_score_mod else 1.0
  k = score.exp2_constant * m
  if rest is None:
    queries = -lse2
  else:
    queries = (rest.vector if isinstance(rest, mod_functions.Along) else rest) - lse2
  init = lax.broadcast_in_dim(queries * jnp.float32(1.0 / k), q_idx.shape, [query_axis])
  if key is not None:  # (has_score_mod: C is there)
    init = init + lax.broadcast_in_dim(key.vector * jnp.float32(1.0 / m), q_idx.shape,
                                       [key.axis])
  return init, k


@dataclasses.dataclass(frozen=True)
class ModStatics:
  """The static part of the mods of a kernel: the traced functions and how
  their operands come (`ModRefs`)."""

  score_mod: Any  # mod_functions.ModFunction or None
  mask_mod: Any
  per_head: bool  # one block list per query head (else one for every head)
  has_offsets: bool  # a sharded call's (batch, head) offsets, int32 [2]
  num_score_captured: int
  num_mask_captured: int
  # Every position a kernel's tiles hold is below it (their padded extents
  # plus a tile): the mods' interpreter converts q_idx - kv_idx to float
  # exactly by its two vectors below 2**24 (`mod_functions.Along`). None:
  # unknown, no such rewrite.
  position_bound: int | None = None
  # The kernels' CTAs take their tiles in an order given as data: one int32
  # [B, tiles] operand per kernel after the block lists (`ModRefs.tile_order`,
  # `backward_inputs.heavy_tiles_first`), the tiles with the longest lists
  # first. False: the grid's own order.
  tile_order: bool = False

  @classmethod
  def of(cls, mods, classes) -> "ModStatics":
    """The statics of `mods` (a `scores.Scores`) whose lists were made from
    `classes` (int8 [B, Hm, ...]: `scores.tile_classes`)."""
    return cls(score_mod=mods.score_mod, mask_mod=mods.mask_mod,
               per_head=classes.shape[1] > 1, has_offsets=mods.index_offsets is not None,
               num_score_captured=len(mods.score_captured),
               num_mask_captured=len(mods.mask_captured))


@dataclasses.dataclass(frozen=True)
class BlockList:
  """One CTA tile's walk: `num_partial` PARTIAL blocks, then FULL ones up
  to `total`; `block(n)` is the n-th block's index."""

  order: Any  # GMEM ref [B, Hm, tiles, blocks]
  at: tuple  # (batch, head, tile) into it
  num_partial: Any
  total: Any

  def block(self, n):
    return self.order[(*self.at, n)]


@dataclasses.dataclass(frozen=True)
class ModRefs:
  """The mods' inputs of a kernel, after its segment ids: the block lists
  (`scores.block_lists` of its CTA tiles: counts int32 [B, Hm, tiles, 2],
  order int32 [B, Hm, tiles, blocks]), the CTAs' tile order with
  `ModStatics.tile_order`, the (batch, head) offsets if any, the
  score_mod's captured arrays, the mask_mod's (0-d ones as shape (1,))."""

  counts: Any
  order: Any
  offsets: Any  # None without offsets
  score_captured: tuple
  mask_captured: tuple
  tile_order: Any = None  # int32 [B, tiles] (`ModStatics.tile_order`); None: the grid's

  def cta_tile(self, batch_idx, position):
    """The tile the CTA at grid `position` along the tiles' axis takes:
    `tile_order`'s entry, or the position itself without one."""
    if self.tile_order is None:
      return position
    return self.tile_order[batch_idx, position]

  @classmethod
  def split(cls, refs, statics: ModStatics | None):
    """(the mods' refs, the rest); (None, refs) without mods."""
    refs = list(refs)
    if statics is None:
      return None, refs
    counts, order = refs.pop(0), refs.pop(0)
    tile_order = refs.pop(0) if statics.tile_order else None
    offsets = refs.pop(0) if statics.has_offsets else None
    score_captured = tuple(refs.pop(0) for _ in range(statics.num_score_captured))
    mask_captured = tuple(refs.pop(0) for _ in range(statics.num_mask_captured))
    return cls(counts, order, offsets, score_captured, mask_captured, tile_order), refs

  def walk(self, statics: ModStatics, batch_idx, head, tile) -> BlockList:
    """The block list of CTA tile `tile` of (`batch_idx`, query `head`)."""
    at = (batch_idx, head if statics.per_head else 0, tile)
    num_partial = self.counts[(*at, 0)]
    return BlockList(self.order, at, num_partial, num_partial + self.counts[(*at, 1)])

  def group_walk(self, statics: ModStatics, batch_idx, kv_head, kv_tile, group: int, g):
    """(the block list, the query head) of the g-th query head of `kv_head`'s
    GQA group for key tile `kv_tile`: a kernel that owns keys (dK/dV) walks
    its group's heads one after the other."""
    head = kv_head * group + g
    return self.walk(statics, batch_idx, head, kv_tile), head

  def group_steps(self, statics: ModStatics, batch_idx, kv_head, kv_tile, group: int):
    """The blocks of every head's list of `group_walk`, in all."""
    total = lambda g, n: n + self.group_walk(statics, batch_idx, kv_head, kv_tile, group,
                                             g)[0].total
    return lax.fori_loop(0, group, total, jnp.int32(0))

  def on_rows(self, statics: ModStatics, batch_idx, head, loader=None) -> "TileMods":
    """The mods of tiles of (`batch_idx`, query `head`), local indices.
    `loader`: the kernel's per-element reads of captured arrays
    (`mod_functions.bind`), or None."""
    if self.offsets is not None:
      batch_idx, head = batch_idx + self.offsets[0], head + self.offsets[1]
    bound = lambda mod, refs: None if mod is None else mod_functions.bind(
        mod, refs, batch_idx, head, loader=loader)
    return TileMods(bound(statics.score_mod, self.score_captured),
                    bound(statics.mask_mod, self.mask_captured), statics.position_bound)


@dataclasses.dataclass(frozen=True)
class TileMods:
  """`score_mod` and `mask_mod` on the tiles of one (batch, query head),
  bound to the indices they see (global ones in a sharded call) before the
  walk over blocks, so that their reads of captured arrays happen once
  (`mod_functions.bind`); None where the call has no such mod."""

  score_fn: Any  # mod_functions.BoundMod
  mask_fn: Any
  position_bound: int | None = None  # `ModStatics.position_bound`

  @property
  def score_mod(self):
    return None if self.score_fn is None else self.score_fn.mod

  @property
  def mask_mod(self):
    return None if self.mask_fn is None else self.mask_fn.mod

  def score(self, x, q_idx, kv_idx):
    """(score_mod(x), its derivative in x) on a tile."""
    return self.score_fn.value_and_slope(x, q_idx, kv_idx)

  @property
  def affine(self) -> bool:
    """The score_mod is a * x + R(q_idx) + C(kv_idx) (`mod_functions.affine_form`):
    the sm90 kernels form its logits by `affine_logits`."""
    return self.score_fn is not None and mod_functions.affine_form(self.score_mod) is not None

  def affine_logits(self, s, q_idx, kv_idx, *, score: scores.ScoreFunction, query_axis: int):
    """`affine_logits` of a raw tile `s`, with its slope."""
    return affine_logits(self.score_fn, s, q_idx, kv_idx, score=score, scale=score.scale,
                         query_axis=query_axis, with_slope=True)

  def affine_scores_init(self, q_idx, kv_idx, lse2, *, score: scores.ScoreFunction,
                         query_axis: int):
    """`affine_scores_init` of this tile's score_mod."""
    return affine_scores_init(self.score_fn, q_idx, kv_idx, lse2, score=score,
                              query_axis=query_axis)

  def mask_hook(self):
    """The element mask's `mask_mod` hook (None without a mask_mod)."""
    return bound_mask_hook(self.mask_fn)

  def logits(self, s, q_idx, kv_idx, *, score: scores.ScoreFunction, with_slope: bool):
    """Raw Q K^T scores `s` (f32 tile) in the order of `scores.Scores`:
    x = scale * s, x = score_mod(x), then the built-in modifications of
    `score` (`ScoreFunction.modified_logits`). Returns (t, dt/dx or None):
    the slope (`with_slope`, for dS) is the score_mod's times the built-in
    ones', None where it is 1. `q_idx`, `kv_idx`: the tile's positions
    (int32 tiles of its layout). Without a score_mod the scale stays folded
    into the caller's exp2 constant (`ScoreFunction.logits`), as in the
    plain kernels."""
    if self.score_fn is None:
      t = score.logits(s)
      return t, (score.slope(t) if with_slope else None)
    x = s * jnp.float32(score.scale)
    if with_slope:
      x, slope = self.score(x, q_idx, kv_idx)
    else:
      x, slope = self.score_fn(x, q_idx, kv_idx), None
    x = x.astype(jnp.float32)
    if x.shape != q_idx.shape:  # a score_mod that ignores the score
      x = jnp.broadcast_to(x, q_idx.shape)
      slope = None if slope is None else jnp.broadcast_to(slope, q_idx.shape)
    t = score.modified_logits(x)
    builtin_slope = score.slope(t) if with_slope else None
    if builtin_slope is not None:
      slope = slope * builtin_slope
    return t, slope


def walk_block_list(walk: BlockList, block_fn, carry, step0=0):
  """`block_fn(step, j, carry, masked=...)` over `walk`'s blocks j at ring
  positions step0, step0 + 1, ...: the PARTIAL ones masked, then the FULL
  ones."""
  partial = lambda n, c: block_fn(step0 + n, walk.block(n), c, masked=True)
  full = lambda n, c: block_fn(step0 + n, walk.block(n), c, masked=False)
  carry = lax.fori_loop(0, walk.num_partial, partial, carry)
  return lax.fori_loop(walk.num_partial, walk.total, full, carry)
