"""Attention against a paged KV cache, for serving: `paged_attention`.

The cache is a pool of fixed-size pages shared by every sequence, in the
layout vLLM and FlashInfer use: `key_pages`, `value_pages`
[num_pages, page_size, kv_heads, head_dim]. A page table [B, max_pages]
lists each row's pages in order; row b's keys are the first
`key_value_seq_lengths[b]` of the concatenation of its pages.

What runs where (`which_paged_implementation` says which, "sm90" or "xla"):

* Hopper GPU: the sm90 forward kernel in the decode arrangement of
  `fa4_jax.decode` (a KV head's query heads packed as the rows of one tile,
  the cache split into chunks of whole pages, each chunk a batch row with its
  own row of the page table and its own length), reading K and V through the
  page table: one TMA copy per page, no gather of the cache.
* Everywhere else, and for what the kernel cannot serve: the XLA path, which
  gathers each row's pages into a contiguous cache and calls the XLA
  attention with an explicit mask. It is also the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import backends, interpret
from fa4_jax.scores import FP8_DTYPES
from fa4_jax.validation import (as_array, check_descale, check_dtypes, check_output_dtype,
                                check_scale, check_sinks, check_soft_cap, dtype_name,
                                is_concrete, values_from_keys)

PagedImplementation = Literal["xla", "sm90"] | None
IMPLEMENTATION_CHOICES = (None, "xla", "sm90")


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
      tokens against the cache, ALiBi, ...). Read by the XLA path for now.
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
  page sizes that are powers of two >= 8 (16, 32, 64, 128, ...), at most 256
  query rows per KV head (`T * Hq / Hkv`) when every query of a row sees
  the same keys (`T = 1`, or `is_causal=False`: the decode arrangement,
  which packs the query heads of a KV head as rows and splits the cache).
  Chunked prefill (`T > 1`, `is_causal=True`: each row's queries are the
  last `T` tokens of its context, a band aligned per row by its length)
  runs the sm90 forward kernel itself, any `T`, reading the pages as well.
  Cache entries past a row's length (and in the pages it loads for the
  last block) must be finite: they are multiplied by zero weights.

  Gradients: this is a serving op. Where asked for, they are the XLA path's
  (it gathers the pages), also when the forward ran the kernel.
  """
  args = _validate(query, key_pages, value_pages, page_table, key_value_seq_lengths,
                   scale=scale, is_causal=is_causal, sinks=sinks,
                   logits_soft_cap=logits_soft_cap, implementation=implementation,
                   descales=(query_descale, key_descale, value_descale),
                   output_dtype=output_dtype, value_head_dim=value_head_dim,
                   mods=dict(score_mod=score_mod, mask_mod=mask_mod))
  arrays = (args.query, args.key_pages, args.value_pages, args.page_table, args.lengths,
            args.sinks)
  if _select(implementation, args) == "xla":
    return _xla_forward(*arrays, args.static, args.descales, args.mods)
  return _kernel_forward(*arrays, args.static)


def which_paged_implementation(query, key_pages, value_pages, page_table,
                               key_value_seq_lengths, *, scale=None, is_causal=True, sinks=None,
                               logits_soft_cap=None,
                               implementation: PagedImplementation = None, query_descale=None,
                               key_descale=None, value_descale=None, output_dtype=None,
                               value_head_dim=None, score_mod=None, mask_mod=None) -> str:
  """What `paged_attention` runs for these arguments here: "sm90" (the
  Hopper kernel reading the pages) or "xla". Raises as `paged_attention`
  would."""
  args = _validate(query, key_pages, value_pages, page_table, key_value_seq_lengths,
                   scale=scale, is_causal=is_causal, sinks=sinks,
                   logits_soft_cap=logits_soft_cap, implementation=implementation,
                   descales=(query_descale, key_descale, value_descale),
                   output_dtype=output_dtype, value_head_dim=value_head_dim,
                   mods=dict(score_mod=score_mod, mask_mod=mask_mod))
  return _select(implementation, args)


# --- arguments ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
  """The call's compile-time constants."""

  scale: float
  is_causal: bool
  soft_cap: float | None
  output_dtype: object = None  # float8 pages: the output's dtype (validation)
  value_head_dim: int | None = None  # `value_pages=None`: the values are the keys' first ones


@dataclasses.dataclass(frozen=True)
class _Arguments:
  query: jax.Array
  key_pages: jax.Array
  value_pages: jax.Array
  page_table: jax.Array  # int32
  lengths: jax.Array  # int32
  sinks: jax.Array | None
  static: _Static
  # float8: float32 descales of the query, keys and values (None: 1).
  descales: tuple = (None, None, None)
  # score_mod / mask_mod (None where not given), passed on to the XLA path.
  mods: dict = dataclasses.field(default_factory=dict)


def _validate(query, key_pages, value_pages, page_table, lengths, *, scale, is_causal, sinks,
              logits_soft_cap, implementation, descales=(None, None, None),
              output_dtype=None, value_head_dim=None, mods=None) -> _Arguments:
  if implementation not in IMPLEMENTATION_CHOICES:
    raise ValueError(
        f"`implementation` must be one of {IMPLEMENTATION_CHOICES}; got {implementation!r}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"`is_causal` must be a bool; got {is_causal!r}")
  query, key_pages = as_array(query, "query"), as_array(key_pages, "key_pages")
  if value_pages is not None:
    value_pages = as_array(value_pages, "value_pages")
  _check_cache(query, key_pages, value_pages)
  # MLA (`value_pages=None`): the values are the keys' first value_head_dim features.
  value_head_dim, value_descale = values_from_keys(
      value_pages, value_head_dim, key_pages.shape[-1], descales[1], descales[2],
      value_name="value_pages", keys_name="key pages'")
  descales = (descales[0], descales[1], value_descale)
  b = query.shape[0]
  page_table = _check_integer(page_table, "page_table", 2, "[batch, max_pages]")
  if page_table.shape[0] != b or page_table.shape[1] == 0:
    raise ValueError(f"`page_table` shape must be (batch, max_pages >= 1) with batch {b}; "
                     f"got {page_table.shape}")
  lengths = _check_integer(lengths, "key_value_seq_lengths", 1, "[batch]")
  if lengths.shape != (b,):
    raise ValueError(f"`key_value_seq_lengths` shape must be (batch,) = ({b},); "
                     f"got {lengths.shape}")
  capacity = page_table.shape[1] * key_pages.shape[1]
  if is_concrete(lengths):
    values = np.asarray(lengths)
    if values.min() < 0 or values.max() > capacity:
      raise ValueError(
          f"`key_value_seq_lengths` values must lie in [0, {capacity}] (max_pages * "
          f"page_size); got min {values.min()}, max {values.max()}")
  static = _Static(scale=check_scale(scale, query.shape[-1]), is_causal=bool(is_causal),
                   soft_cap=check_soft_cap(logits_soft_cap), value_head_dim=value_head_dim,
                   output_dtype=check_output_dtype(output_dtype, query.dtype, key_pages.dtype))
  heads, kv_heads = query.shape[2], key_pages.shape[2]
  descales = tuple(
      check_descale(x, f"{name}_descale", operand, dtype, n, heads_name)
      for x, name, operand, dtype, n, heads_name in zip(
          descales, ("query", "key", "value"), ("query", "key_pages", "value_pages"),
          (query.dtype, key_pages.dtype, (key_pages if value_pages is None else value_pages).dtype),
          (heads, kv_heads, kv_heads),
          ("query head", "key/value head", "key/value head")))
  return _Arguments(query, key_pages, value_pages, page_table, lengths,
                    check_sinks(sinks, heads), static, descales,
                    {k: v for k, v in (mods or {}).items() if v is not None})


def _check_cache(query, key_pages, value_pages) -> None:
  """`value_pages` None: the values are a prefix of the keys' features."""
  for name, x, layout in (("query", query, "[batch, tokens, heads, head_dim]"),
                          ("key_pages", key_pages, "[num_pages, page_size, heads, head_dim]"),
                          ("value_pages", value_pages, "[num_pages, page_size, heads, head_dim]")):
    if x is None:
      continue
    if x.ndim != 4:
      raise ValueError(f"`{name}` must be rank 4, {layout}; got shape {x.shape}")
    if 0 in x.shape:
      raise ValueError(f"`{name}` must not be empty; got shape {x.shape}")
  values = key_pages if value_pages is None else value_pages
  check_dtypes(query, key_pages, values, "key_pages", "value_pages")
  if values.shape[:-1] != key_pages.shape[:-1]:
    raise ValueError(f"`value_pages` shape must equal `key_pages` shape {key_pages.shape} but "
                     f"for its head dim, which may differ; got {value_pages.shape}")
  if query.shape[3] != key_pages.shape[3]:
    raise ValueError(f"`query` head_dim ({query.shape[3]}) must equal `key_pages` head_dim "
                     f"({key_pages.shape[3]})")
  if query.shape[2] % key_pages.shape[2]:
    raise ValueError(f"`query` heads ({query.shape[2]}) must be a multiple of `key_pages` "
                     f"heads ({key_pages.shape[2]})")


def _check_integer(x, name: str, rank: int, layout: str) -> jax.Array:
  x = as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array (int32); got {dtype_name(x.dtype)}")
  if x.ndim != rank:
    raise ValueError(f"`{name}` must be rank {rank}, {layout}; got shape {x.shape}")
  return x.astype(jnp.int32)


# --- selection ---------------------------------------------------------------


def _select(implementation, args: _Arguments) -> str:
  """"xla" or "sm90"; raises ValueError when "sm90" was asked for and cannot
  serve. None takes the kernel only on a Hopper GPU (as `fa4_jax.attention`
  does: inside `interpret_mode()` the kernel runs when asked for by name)."""
  if implementation == "xla":
    return "xla"
  problem = _kernel_problem(args)
  if implementation == "sm90":
    if problem is not None:
      raise ValueError(f"implementation='sm90': {problem}")
    return "sm90"
  return "sm90" if problem is None and backends.device_arch_major() == 9 else "xla"


def _kernel_problem(args: _Arguments) -> str | None:
  """Why the sm90 kernel cannot serve the call here, or None if it can."""
  from fa4_jax import decode
  from fa4_jax.kernels import KernelUnsupported, sm90_forward

  if not interpret.is_interpreting() and backends.device_arch_major() != 9:
    return ("needs a Hopper (compute capability 9.x) GPU as the default device, or "
            "fa4_jax.interpret_mode()")
  if args.key_pages.dtype in FP8_DTYPES:
    return "float8 pages are read by the XLA path for now; use implementation=None or 'xla'"
  if args.mods:
    return ("score_mod / mask_mod over pages are read by the XLA path for now; use "
            "implementation=None or 'xla'")
  if args.value_pages is None or args.value_pages.shape[-1] != args.key_pages.shape[-1]:
    return ("a value head dim other than the keys' (MLA's latent pages, `value_pages=None`) "
            "is read by the XLA path for now; use implementation=None or 'xla'")
  q_shape = args.query.shape
  try:
    k_shape = sm90_forward.check_paged(q_shape, args.key_pages.shape, args.page_table.shape)
    sm90_forward.check_supported(q_shape, k_shape, args.query.dtype, _mask(args.static, q_shape))
  except KernelUnsupported as e:
    return str(e)
  if _is_prefill(args.static, q_shape):
    return None  # the forward kernel as it is: any number of query rows
  if _plan(args) is None:
    return (f"T * Hq / Hkv = {q_shape[1] * q_shape[2] // k_shape[2]} query rows per KV head; "
            f"the decode arrangement packs at most {decode.MAX_PACKED_ROWS}")
  return None


def _is_prefill(static: _Static, q_shape) -> bool:
  """Causal with several query tokens: each row's band sits at its length."""
  return static.is_causal and q_shape[1] > 1


def _mask(static: _Static, q_shape):
  """The kernels' mask: bottom-right causal aligned per row by the lengths
  (the queries' lengths are T) for chunked prefill, else no band."""
  from fa4_jax.scores import MaskSpec

  return (MaskSpec(right=0, offset_from_lengths=True) if _is_prefill(static, q_shape)
          else MaskSpec())


def _plan(args: _Arguments):
  """The decode plan: chunks of whole pages, balanced for ragged lengths."""
  from fa4_jax import decode
  from fa4_jax.scores import MaskSpec

  b, _, _, d = args.query.shape
  page_size, kv_heads = args.key_pages.shape[1], args.key_pages.shape[2]
  k_shape = (b, args.page_table.shape[1] * page_size, kv_heads, d)
  return decode.plan(args.query.shape, k_shape, MaskSpec(), ragged=True, granule=page_size)


# --- the two paths -----------------------------------------------------------


def gather_pages(pages, page_table):
  """[num_pages, page_size, H, D] and [B, P] -> [B, P * page_size, H, D]:
  each row's pages in order (entries clipped into range, as the kernel does)."""
  rows = jnp.take(pages, page_table, axis=0, mode="clip")  # [B, P, page_size, H, D]
  b, p, page_size, h, d = rows.shape
  return rows.reshape(b, p * page_size, h, d)


def _xla_forward(q, key_pages, value_pages, page_table, lengths, sinks, static: _Static,
                 descales=(None, None, None), mods=None):
  """The pages gathered into contiguous rows, then the XLA attention with
  the bottom-right mask: exact, differentiable, and the reference."""
  query_descale, key_descale, value_descale = descales
  from fa4_jax.api import attention

  k = gather_pages(key_pages, page_table)
  v = (k[..., :static.value_head_dim] if value_pages is None
       else gather_pages(value_pages, page_table))
  # Causal: query t sits at position length - T + t and sees keys up to it.
  return attention(q, k, v, scale=static.scale, is_causal=static.is_causal,
                   causal_alignment="bottom_right", key_value_seq_lengths=lengths,
                   sinks=sinks, logits_soft_cap=static.soft_cap, implementation="xla",
                   query_descale=query_descale, key_descale=key_descale,
                   value_descale=value_descale, output_dtype=static.output_dtype,
                   **(mods or {}))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kernel_forward(q, key_pages, value_pages, page_table, lengths, sinks, static: _Static):
  """The sm90 kernel reading through the table: the forward kernel itself
  for chunked prefill, else in the decode arrangement."""
  from fa4_jax import decode
  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  if _is_prefill(static, q.shape):
    options = {} if static.soft_cap is None else dict(soft_cap=static.soft_cap)
    if sinks is not None:
      options["sinks"] = sinks
    q_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    out, _ = sm90_forward.forward(q, key_pages, value_pages, q_lengths, lengths,
                                  scale=static.scale, mask=_mask(static, q.shape),
                                  page_table=page_table, **options)
    return out
  args = _Arguments(q, key_pages, value_pages, page_table, lengths, sinks, static)
  out, _ = decode.forward(q, key_pages, value_pages, None, lengths, scale=static.scale,
                          mask=MaskSpec(), plan=_plan(args), sinks=sinks,
                          soft_cap=static.soft_cap, page_table=page_table)
  return out


def _kernel_forward_fwd(q, key_pages, value_pages, page_table, lengths, sinks, static):
  out = _kernel_forward(q, key_pages, value_pages, page_table, lengths, sinks, static)
  return out, (q, key_pages, value_pages, page_table, lengths, sinks)


def _kernel_forward_bwd(static, residuals, dout):
  """The XLA path's gradient (a serving op: no kernel backward)."""
  q, key_pages, value_pages, page_table, lengths, sinks = residuals
  _, vjp = jax.vjp(lambda q, kp, vp, s: _xla_forward(q, kp, vp, page_table, lengths, s, static),
                   q, key_pages, value_pages, sinks)
  dq, dk, dv, dsinks = vjp(dout)
  return dq, dk, dv, None, None, dsinks


_kernel_forward.defvjp(_kernel_forward_fwd, _kernel_forward_bwd)
