"""Attention against a paged KV cache, for serving: `paged_attention`.

The cache is a pool of fixed-size pages shared by every sequence, in the
layout vLLM and FlashInfer use: `key_pages`, `value_pages`
[num_pages, page_size, kv_heads, head_dim]. A page table [B, max_pages]
lists each row's pages in order; row b's keys are the first
`key_value_seq_lengths[b]` of the concatenation of its pages.

What runs where (`which_paged_implementation` says which: "sm90", "sm90_mla"
or "xla"):

* Hopper GPU: the sm90 forward kernel in the decode arrangement of
  `fa4_jax.kernels.sm90_decode` (a KV head's query heads packed as the rows
  of one tile, the cache split into chunks of whole pages, each chunk a batch
  row with its own row of the page table and its own length; causal T > 1
  with the band of each row), reading K and V through the page table: one
  TMA copy per page, no gather of the cache. Causal queries of more than
  256 packed rows: the forward kernel itself, through the table as well.
  Latent pages (MLA, `value_pages=None`): the MLA decode kernel of
  `fa4_jax.kernels.sm90_mla_decode` ("sm90_mla"), through the table too.
* Everywhere else, and for what the kernel cannot serve: the XLA path, which
  gathers each row's pages into a contiguous cache and calls the XLA
  attention with an explicit mask. It is also the reference.

As for `fa4_jax.attention`, the arguments are checked in `fa4_jax.validation`
(`validate_paged`) and the path is chosen in `fa4_jax.backends`
(`select_paged`), which also calls the kernels (`paged_kernel_forward`);
this module holds the API and the XLA path.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from fa4_jax.backends import paged_kernel_forward, select_paged
from fa4_jax.validation import PagedStatic, validate_paged

PagedImplementation = Literal["xla", "sm90"] | None


def paged_attention(query, key_pages, value_pages, page_table, key_value_seq_lengths, *,
                    scale: float | None = None, is_causal: bool = True, sinks=None,
                    logits_soft_cap: float | None = None,
                    implementation: PagedImplementation = None, query_descale=None,
                    key_descale=None, value_descale=None, output_dtype=None,
                    value_head_dim=None, score_mod=None, mask_mod=None):
  """Attention of the newest tokens of each row against its paged KV cache.

  Args:
    query: `[B, T, Hq, D]`, the LAST `T` tokens of each row's context
      (whose keys and values are already in the cache): query `t` of row `b`
      sits at position `key_value_seq_lengths[b] - T + t` (bottom-right
      alignment). bfloat16, float16, float32 or float64.
    key_pages, value_pages: `[num_pages, page_size, Hkv, D]`, the page pool
      (vLLM / FlashInfer layout: page, token in page, head, head_dim), the
      query's dtype (or float8: see `key_descale`); `Hq % Hkv == 0` (GQA; 1
      is MQA). `value_pages` may have its own head dim `Dv` (the output's),
      or be None with `value_head_dim=Dv`: the values are the first `Dv`
      features of the key pages (MLA's latent cache: 576 features per token
      of one head, the first 512 the values).
    page_table: integer `[B, max_pages]`: logical page `p` of row `b` (keys
      `p * page_size .. (p + 1) * page_size - 1`) is physical page
      `page_table[b, p]`. Entries past `ceil(length / page_size)` are
      ignored and may hold anything (the kernel clips them into range and
      loads them; keys past the length get zero weight).
    key_value_seq_lengths: integer `[B]`, in `[0, max_pages * page_size]`:
      row `b`'s cache holds keys `0 .. length - 1`.
    scale: logit scale; default `1 / sqrt(D)`.
    is_causal: True (default): query `t` sees keys `j <= length - T + t`,
      causal among the new tokens; for `T = 1` that is every valid key. A
      query whose position is negative (`length < T`) sees nothing and gets
      zeros. False: every query sees all `length` keys.
    sinks: optional float `[Hq]`, one logit per query head (as in
      `fa4_jax.attention`).
    logits_soft_cap: optional positive number `cap`: logits ->
      `cap * tanh(logits / cap)` (as in `fa4_jax.attention`).
    implementation: None (the sm90 kernel on a Hopper GPU when it can serve
      the call, else the XLA path), "xla", or "sm90" (a ValueError saying
      why when it cannot; without a Hopper GPU it runs only inside
      `fa4_jax.interpret_mode()`).
    value_head_dim: with `value_pages=None` (only then): how many leading
      features of each key are its value.
    score_mod, mask_mod: as in `fa4_jax.attention` (FlexAttention's
      contract): `q_idx` is the query's index in `query` (0 .. T-1),
      `kv_idx` the key's position in its row's cache (a tree of draft
      tokens against the cache, ALiBi, ...). The kernel runs them in the
      decode arrangement (up to 256 packed rows, 16-bit pages with values of
      the keys' head dim); beyond it, the XLA path.
    query_descale, key_descale, value_descale, output_dtype: float8 pages
      (`float8_e4m3fn` or `float8_e5m2`, with a bfloat16 / float16 query or
      a query of the pages' float8 dtype), as in `fa4_jax.attention`: the
      real value is the stored one times its descale (a scalar or one per
      head). Read by the XLA path for now (the pages gathered in float8 and
      widened a block at a time).

  Returns:
    `[B, T, Hq, Dv]` (Dv: the values' head dim) in the query's dtype
    (float8: `output_dtype`, by default bfloat16 or the query's); a query
    that sees no key gets zeros.

  The sm90 kernel serves: bfloat16 / float16, head_dim 64, 128, 192 or 256,
  page sizes that are powers of two >= 8 (16, 32, 64, 128, ...). Up to 256
  query rows per KV head (`T * Hq / Hkv`) it runs in the decode
  arrangement (which packs the query heads of a KV head as rows and splits
  the cache into chunks of whole pages), causal or not: with `T > 1` and
  `is_causal=True` (speculative decoding's new tokens, a short chunk of a
  chunked prefill) each packed row sits at its token's position and each
  chunk sees its part of the row's band (`fa4_jax.kernels.sm90_decode`).
  Longer causal queries (chunked prefill) run the sm90 forward kernel
  itself, any `T`, one CTA per query tile and head, reading the pages as
  well.
  Cache entries past a row's length (and in the pages it loads for the
  last block) must be finite: they are multiplied by zero weights.

  Gradients: this is a serving op. Where asked for, they are the XLA path's
  (it gathers the pages), also when the forward ran the kernel.
  """
  args = _validated(**locals())
  arrays = (args.query, args.key_pages, args.value_pages, args.page_table, args.lengths,
            args.sinks)
  if select_paged(implementation, args) == "xla":
    return _xla_forward(*arrays, args.static, args.descales, args.mods)
  return _kernel_forward(*arrays, args.descales, args.traced_mods, args.static)


def which_paged_implementation(query, key_pages, value_pages, page_table,
                               key_value_seq_lengths, *, scale=None, is_causal=True, sinks=None,
                               logits_soft_cap=None,
                               implementation: PagedImplementation = None, query_descale=None,
                               key_descale=None, value_descale=None, output_dtype=None,
                               value_head_dim=None, score_mod=None, mask_mod=None) -> str:
  """What `paged_attention` runs for these arguments here: "sm90" (the
  Hopper kernels reading the pages), "sm90_mla" (the MLA decode kernel
  reading latent pages, `value_pages=None`) or "xla". Raises as
  `paged_attention` would."""
  args = _validated(**locals())
  return select_paged(implementation, args)


def _validated(query, key_pages, value_pages, page_table, key_value_seq_lengths, *, scale,
               is_causal, sinks, logits_soft_cap, implementation, query_descale, key_descale,
               value_descale, output_dtype, value_head_dim, score_mod, mask_mod):
  """`validation.validate_paged` of the two entry points' arguments."""
  return validate_paged(query, key_pages, value_pages, page_table, key_value_seq_lengths,
                        scale=scale, is_causal=is_causal, sinks=sinks,
                        logits_soft_cap=logits_soft_cap, implementation=implementation,
                        descales=(query_descale, key_descale, value_descale),
                        output_dtype=output_dtype, value_head_dim=value_head_dim,
                        mods=dict(score_mod=score_mod, mask_mod=mask_mod))


# --- the XLA path, and the kernels' gradient ---------------------------------


def gather_pages(pages, page_table):
  """[num_pages, page_size, H, D] and [B, P] -> [B, P * page_size, H, D]:
  each row's pages in order (entries clipped into range, as the kernel does)."""
  rows = jnp.take(pages, page_table, axis=0, mode="clip")  # [B, P, page_size, H, D]
  b, p, page_size, h, d = rows.shape
  return rows.reshape(b, p * page_size, h, d)


def _xla_forward(q, key_pages, value_pages, page_table, lengths, sinks, static: PagedStatic,
                 descales=(None, None, None), mods=None):
  """The pages gathered into contiguous rows, then the XLA attention with
  the bottom-right mask: exact, differentiable, and the reference."""
  query_descale, key_descale, value_descale = descales
  from fa4_jax.api import attention

  k = gather_pages(key_pages, page_table)
  v = (k[..., :static.value_head_dim] if value_pages is None
       else gather_pages(value_pages, page_table))
  # Causal: query t sits at position length - T + t and sees keys up to it.
  return attention(q, k, v, scale=static.score.scale, is_causal=static.is_causal,
                   causal_alignment="bottom_right", key_value_seq_lengths=lengths,
                   sinks=sinks, logits_soft_cap=static.score.cap, implementation="xla",
                   query_descale=query_descale, key_descale=key_descale,
                   value_descale=value_descale, output_dtype=static.output_dtype,
                   **(mods or {}))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kernel_forward(q, key_pages, value_pages, page_table, lengths, sinks, descales, mods,
                    static: PagedStatic):
  """The kernel `backends.select_paged` chose, reading through the table
  (`backends.paged_kernel_forward`); its gradient is the XLA path's.
  `mods`: None, or the traced `score_mod` / `mask_mod` as a `scores.Scores`
  (`PagedArguments.traced_mods`; the decode arrangement only)."""
  return paged_kernel_forward(q, key_pages, value_pages, page_table, lengths, sinks, descales,
                              mods, static)


def _kernel_forward_fwd(q, key_pages, value_pages, page_table, lengths, sinks, descales, mods,
                        static):
  out = _kernel_forward(q, key_pages, value_pages, page_table, lengths, sinks, descales, mods,
                        static)
  return out, (q, key_pages, value_pages, page_table, lengths, sinks, descales, mods)


def _kernel_forward_bwd(static, residuals, dout):
  """The XLA path's gradient (a serving op: no kernel backward; float8
  pages raise there, as every float8 call does), to the mods' captured
  arrays too."""
  q, key_pages, value_pages, page_table, lengths, sinks, descales, mods = residuals
  _, vjp = jax.vjp(lambda q, kp, vp, s, m: _xla_forward(q, kp, vp, page_table, lengths, s, static,
                                                        descales, _user_mods(m)),
                   q, key_pages, value_pages, sinks, mods)
  dq, dk, dv, dsinks, dmods = vjp(dout)
  return dq, dk, dv, None, None, dsinks, jax.tree.map(jnp.zeros_like, descales), dmods


def _user_mods(mods):
  """Traced mods (`PagedArguments.traced_mods`) as the functions `fa4_jax.attention`
  takes, over their captured arrays as given; None for None."""
  if mods is None:
    return None
  from fa4_jax import mod_functions

  def as_function(mod, captured):
    return None if mod is None else (
        lambda *args: mod_functions.evaluate(mod, captured, *args))

  return dict(score_mod=as_function(mods.score_mod, mods.score_captured),
              mask_mod=as_function(mods.mask_mod, mods.mask_captured))


_kernel_forward.defvjp(_kernel_forward_fwd, _kernel_forward_bwd)
