"""Attention backward for Blackwell (sm_100) in Pallas Mosaic GPU.

The same three steps as the Hopper backward (`sm90_backward`), with every
accumulator in tensor memory (TMEM) instead of registers:

1. `backward_inputs.preprocess` (plain XLA): lse2 (log2 units, +inf on rows
   that must not contribute) and delta = rowsum(dO * O), padded to whole
   128-row tiles.
2. the dK/dV kernel (`sm100_backward_dkdv`): one CTA per (kv head, 128-key
   tile, batch) walks the query blocks of every head of its GQA group that
   its keys can be seen by; S^T, dP^T, dK and dV live in TMEM, P^T and dS^T
   feed the dV and dK MMAs straight from TMEM.
3. the dQ kernel (`sm100_backward_dq`): one CTA per (q head, 128-row Q
   tile, batch) walks the key blocks its rows see; S, dP and dQ live in
   TMEM, dS feeds the dQ MMA from TMEM.

Every gradient element is written by exactly one CTA (deterministic, no
atomics), as on Hopper: the dQ kernel recomputes S and dP (7 MMAs of a
tile pair instead of 5) rather than summing partial dQ tiles in arrival
order. Masks (causal, windows, lengths, bottom-right alignment, segment
ids) skip whole tiles in both kernels and apply the element mask only on
boundary tiles; soft-cap multiplies dS by its slope (`ScoreFunction.slope`);
sinks need nothing (the lse includes them).

Head dims 64 and 128. At 256 dK and dV of a 128-key tile take all 512 TMEM
columns, leaving none for S^T and dP^T (`sm100_backward_dkdv.choose_config`),
so `check_supported` refuses it and `fa4_jax.backends` runs the XLA
backward there.

Programmable scores (`backward(..., mods=)`, the call's `scores.Scores`
with a `score_mod` and / or a `mask_mod`): the classes of every mask (the
built-ins, mask_mod, a block mask where its tiles nest) are evaluated once
in XLA at tiles dividing both kernels' CTA tiles (`_kernel_mods`) and
turned into block lists (`backward_inputs.mod_operands`): per 128-row Q
tile the key blocks of the dQ kernel, per 128-key tile and query head the
query blocks of the dK/dV kernel (the transposed classes; a GQA CTA walks
its group's heads' lists one after the other). Every role of a kernel
walks the same list (PARTIAL blocks, then FULL ones; EMPTY ones are never
loaded), so the barrier protocol is the plain one block for block. The
compute warpgroups bind the mods to the (batch, query head) once per walk
(`mod_tiles.ModRefs.on_rows`), recompute t from score_mod(scale * s) and
its slope (`mod_tiles.TileMods.logits`: dS is then the gradient w.r.t. the
scaled score, so the kernels' final factor `scale` in dQ and dK stays, as
with soft-cap), and evaluate mask_mod in the element mask of PARTIAL
blocks only. The gradients of score_mod's captured arrays come from one XLA
pass in `backends._captured_grads`. No new barrier, role or TMEM column;
without mods the kernels are unchanged (`tools/kernel_fingerprints.py`).

Never run on Blackwell hardware: verified in Pallas' GPU interpreter with
race detection against an f32 reference, and cross-lowered for sm_100 (TMEM
and SMEM plans, tcgen05 instructions present, no wgmma). The static cost
model of each kernel is in its module's docstring.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa4_jax.kernels import KernelUnsupported, check_common
from fa4_jax.kernels.backward_inputs import (check_operands, fine_tile_classes, mod_operands,
                                             preprocess)
from fa4_jax.kernels.mod_tiles import ModStatics, check_mods
from fa4_jax.kernels.sm100_forward import kernel_scores
from fa4_jax.kernels import sm100_backward_dkdv, sm100_backward_dq
from fa4_jax.kernels.sm100_backward_dkdv import BLOCK_KV, build_dkv_kernel, dkv_segment_operands
from fa4_jax.kernels.sm100_backward_dq import BLOCK_Q, build_dq_kernel, dq_segment_operands
from fa4_jax.scores import MaskSpec, ScoreFunction, cdiv, check_query_lengths_for_alignment

# The optional arguments of `backward` (`fa4_jax.kernels`: the contract).
FEATURES = frozenset({"score_function", "mods"})

SUPPORTED_HEAD_DIMS = (64, 128)


def check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None:
  """Raises KernelUnsupported when the backward kernels cannot serve the call."""
  *_, head_dim = check_common("sm100 backward", q_shape, k_shape, dtype, mask)
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise KernelUnsupported(
        f"sm100 backward: head_dim must be one of {SUPPORTED_HEAD_DIMS}; got {head_dim} (at 256 "
        f"dK and dV of a 128-key tile fill the 512 TMEM columns; the XLA backward runs instead)")


def _kernel_mods(mods, dkv, dq_plan, batch: int, num_q_heads: int, q_seq: int, kv_seq: int,
                 q_pad: int, kv_pad: int):
  """(`ModStatics`, the dK/dV kernel's mods operands, the dQ kernel's) of a
  call with programmable scores (`mods`: `sm100_forward.kernel_scores`): the
  classes of every mask evaluated once, at tiles that divide both kernels'
  CTA tiles (dK/dV: 128 keys by `dkv.block_q` queries; dQ: 128 rows by
  `dq_plan.block_kv` keys), and each kernel's block lists
  (`backward_inputs.mod_operands`)."""
  fine = (min(dkv.block_q, BLOCK_Q), min(dq_plan.block_kv, BLOCK_KV))
  classes = fine_tile_classes(mods, batch, num_q_heads, q_seq, kv_seq, *fine)
  dkv_operands = mod_operands(mods, classes, fine, q_block=dkv.block_q, kv_block=BLOCK_KV,
                              num_q=cdiv(q_pad, dkv.block_q), num_kv=cdiv(kv_pad, BLOCK_KV),
                              keys_are_rows=True)
  dq_operands = mod_operands(mods, classes, fine, q_block=BLOCK_Q, kv_block=dq_plan.block_kv,
                             num_q=cdiv(q_pad, BLOCK_Q), num_kv=cdiv(kv_pad, dq_plan.block_kv),
                             keys_are_rows=False)
  return ModStatics.of(mods, classes), dkv_operands, dq_operands


def backward(q, k, v, out, lse, dout, q_lengths, kv_lengths, *, score: ScoreFunction,
             mask: MaskSpec, segment_ids=None, mods=None):
  """Gradients (dq, dk, dv) of attention. See `fa4_jax.kernels` for the contract.

  q, out, dout: [B, Tq, Nq, D]; k, v: [B, Tk, Nkv, D]; lse: f32 [B, Nq, Tq].
  dk and dv are summed over the query heads of each GQA group.
  segment_ids: None, or (q ids int32 [B, Tq], kv ids int32 [B, Tk]).
  score: how the forward formed its logits from q.k (`ScoreFunction`: the
  scale, the soft-cap).
  mods: None, or the call's `scores.Scores` where it has a `score_mod` or
  `mask_mod` (its mask, score function, lengths and segment ids are the
  arguments above): both kernels then walk block lists (PARTIAL blocks with
  the element mask and mask_mod, FULL ones without, EMPTY ones never
  loaded) and recompute P with the modified score; dS carries score_mod's
  slope (`mod_tiles.TileMods.logits`). The captured arrays' gradients are
  the caller's (`backends._captured_grads`).
  """
  if mods is not None and not mods.has_mods:
    mods = None
  if mods is not None:
    check_mods("sm100 backward", mods)
  check_query_lengths_for_alignment(mask, q_lengths, "sm100 backward")
  check_supported(q.shape, k.shape, q.dtype, mask)
  check_operands(q, k, v)
  score = score.with_score_mod(mods is not None and mods.score_mod is not None)
  batch, q_seq, num_q_heads, head_dim = q.shape
  _, kv_seq, num_kv_heads, _ = k.shape
  dtype = q.dtype
  dkv = sm100_backward_dkdv.choose_config(head_dim, dtype)
  dq_plan = sm100_backward_dq.choose_config(head_dim, dtype)
  # TMA tiles (sequence, head_dim) by (8, 64): sequences padded to multiples
  # of 8 (a copy only for unaligned lengths).
  q_pad, kv_pad = cdiv(q_seq, 8) * 8, cdiv(kv_seq, 8) * 8
  lse2, delta = preprocess(out, lse, dout, q_lengths, q_pad)

  def pad(x, t_pad):
    return x if t_pad == x.shape[1] else jnp.pad(x, [(0, 0), (0, t_pad - x.shape[1]), (0, 0),
                                                      (0, 0)])

  q, dout = pad(q, q_pad), pad(dout.astype(dtype), q_pad)
  k, v = pad(k, kv_pad), pad(v, kv_pad)
  common = dict(batch=batch, q_seq=q_pad, kv_seq=kv_pad, kv_valid=kv_seq,
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                dtype=dtype, score=score, mask=mask,
                has_q_lengths=q_lengths is not None, has_kv_lengths=kv_lengths is not None,
                has_segments=segment_ids is not None)
  lengths = [jnp.asarray(x, jnp.int32) for x in (q_lengths, kv_lengths) if x is not None]
  dkv_segments, dq_segments = [], []
  if segment_ids is not None:
    q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in segment_ids)
    dkv_segments = dkv_segment_operands(q_ids, kv_ids, dkv, kv_pad)
    dq_segments = dq_segment_operands(q_ids, kv_ids, dq_plan, q_pad)
  dkv_mods, dq_mods = [], []
  if mods is not None:
    mods = kernel_scores(mods, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
                         segment_ids=segment_ids, q_seq=q_seq, kv_seq=kv_seq)
    common["mods"], dkv_mods, dq_mods = _kernel_mods(mods, dkv, dq_plan, batch, num_q_heads,
                                                     q_seq, kv_seq, q_pad, kv_pad)
  args = [q, k, v, dout, lse2, delta, *lengths]
  dk, dv = build_dkv_kernel(**common, block_kv=BLOCK_KV, block_q=dkv.block_q,
                            num_stages=dkv.num_stages)(*args, *dkv_segments, *dkv_mods)
  dq = build_dq_kernel(**common, block_kv=dq_plan.block_kv, block_q=BLOCK_Q,
                       num_stages=dq_plan.num_stages)(*args, *dq_segments, *dq_mods)
  if q_pad != q_seq:
    dq = dq[:, :q_seq]
  if kv_pad != kv_seq:
    dk, dv = dk[:, :kv_seq], dv[:, :kv_seq]
  return dq, dk, dv
