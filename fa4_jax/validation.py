"""Checks every argument of `fa4_jax.attention` and normalizes it.

Each problem is a `ValueError` (or `TypeError` for a wrong Python type) that
names the argument and says what was expected, before anything is traced into
a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import mod_functions
from fa4_jax.scores import FP8_DTYPES, BlockMask, MaskSpec, ScoreFunction, Scores, cdiv

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
# What a call with float8 operands may return (bfloat16 unless `output_dtype`).
FP8_OUTPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
IMPLEMENTATION_CHOICES = (None, "xla", "sm90", "sm100", "cudnn")
PAGED_IMPLEMENTATION_CHOICES = (None, "xla", "sm90")
ALIGNMENTS = ("top_left", "bottom_right")


@dataclasses.dataclass
class Arguments:
  """Validated arguments in the BTNH layout the backends take."""

  query: jax.Array  # [B, T, N, H]
  key: jax.Array  # [B, S, K, H]
  value: jax.Array  # [B, S, K, H]
  bias: jax.Array | None  # [Bb, Nb, Tb, Sb], each 1 or full
  mask: jax.Array | None  # same, bool
  scores: Scores  # everything else that shapes a score
  output_shape: tuple[int, ...]  # the query's own shape (3D or 4D)
  # `value=None`: the value is the key's first features (MLA's latent cache),
  # which the MLA decode kernel reads from the key alone.
  values_from_keys: bool = False

  # The score value's parts, by the names of the arguments they came from.
  @property
  def spec(self) -> MaskSpec:
    return self.scores.mask

  @property
  def scale(self) -> float:
    return self.scores.scale

  @property
  def logits_soft_cap(self) -> float | None:
    return self.scores.soft_cap

  @property
  def query_seq_lengths(self):
    return self.scores.q_lengths

  @property
  def key_value_seq_lengths(self):
    return self.scores.kv_lengths

  @property
  def query_segment_ids(self):
    return self.scores.q_segment_ids

  @property
  def key_value_segment_ids(self):
    return self.scores.kv_segment_ids

  @property
  def sinks(self):
    return self.scores.sinks


def dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def as_array(x, name: str) -> jax.Array:
  try:
    return jnp.asarray(x)
  except TypeError as e:
    raise TypeError(f"`{name}` must be an array, got {type(x).__name__}") from e


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_qkv(query, key, value):
  ranks = (query.ndim, key.ndim, value.ndim)
  if ranks not in ((4, 4, 4), (3, 3, 3)):
    raise ValueError(
        "`query`, `key` and `value` must all be rank 4 (batch, seq, heads, "
        "head_dim) or all rank 3 (seq, heads, head_dim); got ranks "
        f"{ranks[0]}, {ranks[1]} and {ranks[2]}")
  check_dtypes(query, key, value)
  if key.shape[:-1] != value.shape[:-1] or value.shape[-1] == 0:
    raise ValueError(
        f"`value` shape must equal `key` shape {key.shape} but for its head dim, which may "
        f"differ (the output's, e.g. 128 against 192); got {value.shape}")
  if query.shape[0] != key.shape[0]:
    raise ValueError(
        f"`query` batch size ({query.shape[0]}) must equal `key` batch size "
        f"({key.shape[0]})")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
        f"`query` head_dim ({query.shape[-1]}) must equal `key` head_dim "
        f"({key.shape[-1]})")
  n, k = query.shape[2], key.shape[2]
  if n % k != 0:
    raise ValueError(
        f"`query` heads ({n}) must be a multiple of `key`/`value` heads ({k}) "
        "for grouped-query attention")
  if query.shape[1] == 0 or key.shape[1] == 0 or query.shape[-1] == 0:
    raise ValueError(
        f"`query` and `key` need at least one position and a non-empty head_dim; "
        f"got query shape {query.shape} and key shape {key.shape}")


def values_from_keys(value, value_head_dim, key_head_dim: int, key_descale, value_descale, *,
                     value_name: str = "value", keys_name: str = "key"):
  """(value_head_dim, value_descale) where `value` is None: the values are
  the first `value_head_dim` features of each key (MLA's latent cache: keys
  of 576 features whose first 512 are the values), dequantized as the keys
  are. With a `value`: (None, value_descale), and `value_head_dim` must be
  left out. `key_head_dim`: the keys' feature count, the largest allowed."""
  if value is not None:
    if value_head_dim is not None:
      raise ValueError(f"`value_head_dim` applies when `{value_name}` is None (the values are "
                       f"the keys' first `value_head_dim` features); leave it out with a "
                       f"`{value_name}`")
    return None, value_descale
  if (isinstance(value_head_dim, bool) or not isinstance(value_head_dim, (int, np.integer))
      or not 0 < value_head_dim <= key_head_dim):
    raise ValueError(
        f"`{value_name}=None` takes the values from the keys' first `value_head_dim` features: "
        f"`value_head_dim` must be an int in [1, {key_head_dim}] (the {keys_name} head dim); "
        f"got {value_head_dim!r}")
  if value_descale is not None:
    raise ValueError(f"`{value_name}=None` takes the values from the keys, dequantized by "
                     "`key_descale`: leave `value_descale` out")
  return int(value_head_dim), key_descale


def check_dtypes(query, key, value, key_name: str = "key", value_name: str = "value"):
  """One dtype for all three, or float8: all three of one float8 dtype, or a
  bfloat16 / float16 query on float8 keys and values (a float8 KV cache)."""
  names = ("query", key_name, value_name)
  for name, x in zip(names, (query, key, value)):
    if x.dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
      raise ValueError(
          f"`{name}` dtype must be one of bfloat16, float16, float32, float64, "
          f"float8_e4m3fn, float8_e5m2; got {dtype_name(x.dtype)}")
  got = (f"got {dtype_name(query.dtype)}, {dtype_name(key.dtype)} and "
         f"{dtype_name(value.dtype)}")
  if key.dtype in FP8_DTYPES or query.dtype in FP8_DTYPES:
    if key.dtype != value.dtype or key.dtype not in FP8_DTYPES or (
        query.dtype != key.dtype and query.dtype not in (jnp.bfloat16, jnp.float16)):
      raise ValueError(
          f"float8 attention takes `query`, `{key_name}` and `{value_name}` all of one float8 "
          f"dtype, or a bfloat16 / float16 `query` with float8 `{key_name}` and "
          f"`{value_name}`; {got}")
  elif not (query.dtype == key.dtype == value.dtype):
    raise ValueError(
        f"`query`, `{key_name}` and `{value_name}` must have the same dtype; {got}")


def _check_pair_array(x, name: str, full_shape: tuple[int, ...], want_bool: bool):
  """`bias` / `mask`: rank <= 4, broadcastable to [B, N, T, S] dim by dim."""
  if x is None:
    return None
  x = as_array(x, name)
  if want_bool and x.dtype != jnp.bool_:
    raise ValueError(
        f"`mask` must be a boolean array (True = attend); got {dtype_name(x.dtype)}. "
        "Pass an additive mask as `bias`")
  if not want_bool and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"`bias` must be a floating-point array; got {dtype_name(x.dtype)}")
  if x.ndim > 4:
    raise ValueError(f"`{name}` must have rank <= 4 (batch, heads, q_seq, kv_seq); "
                     f"got rank {x.ndim}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(d not in (1, f) for d, f in zip(x.shape, full_shape)):
    raise ValueError(
        f"`{name}` shape {x.shape} must broadcast to (batch, heads, q_seq, kv_seq) "
        f"= {full_shape}, each dimension 1 or equal")
  return x


def _check_lengths(x, name: str, batch: int, limit: int, limit_name: str):
  if x is None:
    return None
  x = as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array (int32); got {dtype_name(x.dtype)}")
  if x.shape != (batch,):
    raise ValueError(f"`{name}` shape must be (batch,) = ({batch},); got {x.shape}")
  if is_concrete(x):
    values = np.asarray(x)
    if values.size and (values.min() < 0 or values.max() > limit):
      raise ValueError(
          f"`{name}` values must lie in [0, {limit}] ({limit_name}); got "
          f"min {values.min()}, max {values.max()}")
  return x.astype(jnp.int32)


def _check_segment_ids(query_ids, key_value_ids, shape_q, shape_k, rank: int):
  """Both or neither; integer [B, T] and [B, S] ([T] and [S] for rank-3
  inputs, like the query); returned as int32 with a batch axis."""
  if (query_ids is None) != (key_value_ids is None):
    given, missing = (("query_segment_ids", "key_value_segment_ids") if key_value_ids is None
                      else ("key_value_segment_ids", "query_segment_ids"))
    raise ValueError(
        f"`{given}` was given without `{missing}`: pass both (a query sees a key "
        "only when their ids are equal) or neither")
  if query_ids is None:
    return None, None
  checked = []
  for name, ids, (b, length), axis in (("query_segment_ids", query_ids, shape_q, "query"),
                                       ("key_value_segment_ids", key_value_ids, shape_k,
                                        "key/value")):
    ids = as_array(ids, name)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"`{name}` must be an integer array (int32); got {dtype_name(ids.dtype)}")
    want = (length,) if rank == 3 else (b, length)
    if ids.shape != want:
      described = "(seq,)" if rank == 3 else "(batch, seq)"
      raise ValueError(
          f"`{name}` shape must be {described} = {want}, the {axis} batch and "
          f"sequence length; got {ids.shape}")
    checked.append(ids.astype(jnp.int32).reshape(b, length))
  return tuple(checked)


def check_sinks(sinks, num_heads: int):
  if sinks is None:
    return None
  sinks = as_array(sinks, "sinks")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"`sinks` must be a floating-point array (one logit per query head); "
                     f"got {dtype_name(sinks.dtype)}")
  if sinks.shape != (num_heads,):
    raise ValueError(f"`sinks` shape must be (query heads,) = ({num_heads},), one logit per "
                     f"query head (also under GQA); got {sinks.shape}")
  return sinks


def check_descale(x, name: str, operand: str, operand_dtype, heads: int, heads_name: str):
  """A float8 operand's descale as float32 [heads] (a scalar broadcast), or
  None (1) when not given."""
  if x is None:
    return None
  if operand_dtype not in FP8_DTYPES:
    raise ValueError(f"`{name}` applies to a float8 `{operand}`; `{operand}` is "
                     f"{dtype_name(operand_dtype)}, so leave `{name}` out")
  x = as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"`{name}` must be floating point (float32); got {dtype_name(x.dtype)}")
  if x.shape not in ((), (1,), (heads,)):
    raise ValueError(f"`{name}` must be a scalar or one factor per {heads_name} "
                     f"(shape ({heads},)); got shape {x.shape}")
  return jnp.broadcast_to(x.astype(jnp.float32).reshape(-1), (heads,))


def check_output_dtype(output_dtype, query_dtype, key_dtype):
  """The output dtype of a call with float8 operands (bfloat16 by default);
  None for other calls, whose output has the query's dtype."""
  if key_dtype not in FP8_DTYPES:
    if output_dtype is not None and jnp.dtype(output_dtype) != query_dtype:
      raise ValueError(
          "`output_dtype` applies to calls with float8 operands; this call's output has the "
          f"query's dtype {dtype_name(query_dtype)}; got output_dtype={output_dtype!r}")
    return None
  if output_dtype is None:
    return jnp.dtype(query_dtype if query_dtype not in FP8_DTYPES else jnp.bfloat16)
  try:
    dtype = jnp.dtype(output_dtype)
  except TypeError as e:
    raise ValueError(f"`output_dtype` must be a dtype; got {output_dtype!r}") from e
  if dtype not in FP8_OUTPUT_DTYPES:
    raise ValueError("`output_dtype` must be bfloat16, float16 or float32; got "
                     f"{dtype_name(dtype)}")
  return dtype


def check_soft_cap(cap):
  if cap is None:
    return None
  if isinstance(cap, jax.core.Tracer):
    raise ValueError("`logits_soft_cap` must be a Python number, not a traced value: it is "
                     "a compile-time constant of the kernels")
  if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)):
    raise ValueError(f"`logits_soft_cap` must be a positive number; got {cap!r}")
  value = float(cap)
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"`logits_soft_cap` must be positive and finite; got {value}")
  return value


def _check_window(local_window_size):
  if local_window_size is None:
    return None
  window = local_window_size
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    window = (int(window), int(window))
  if (not isinstance(window, (tuple, list)) or len(window) != 2
      or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                 for w in window)):
    raise ValueError(
        "`local_window_size` must be an int or a pair of ints (left, right); "
        f"got {local_window_size!r}")
  left, right = int(window[0]), int(window[1])
  if left < 0 or right < 0:
    raise ValueError(f"`local_window_size` sizes must be >= 0; got ({left}, {right})")
  return left, right


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, jax.core.Tracer):
    raise TypeError(
        "`scale` must be a Python number, not a traced value: it is a "
        "compile-time constant of the kernels")
  try:
    value = float(scale)
  except (TypeError, ValueError) as e:
    raise TypeError(f"`scale` must be a number; got {scale!r}") from e
  if not math.isfinite(value):
    raise ValueError(f"`scale` must be finite; got {value}")
  return value


def _align(spec: MaskSpec, alignment, q_lengths, kv_lengths, b: int, t: int, s: int):
  """(spec, q_lengths, kv_lengths) for `causal_alignment`. Bottom-right
  shifts the band by S - T when every row is whole; with lengths, a
  one-token causal query sees every valid key (no band at all), and other
  bands are aligned per row (`MaskSpec.offset_from_lengths`: row b's offset
  is kv_len[b] - q_len[b], resolved in every backend by `at_lengths`). The
  offset needs each row's true query length, so missing query lengths
  become T, and given ones are clipped into [0, T] (and key lengths into
  [0, S]) as every backend clips them when it masks."""
  if alignment not in ALIGNMENTS:
    raise ValueError(f"`causal_alignment` must be one of {ALIGNMENTS}; got {alignment!r}")
  if alignment == "top_left" or spec.is_dense:
    return spec, q_lengths, kv_lengths
  if q_lengths is None and kv_lengths is None:
    return dataclasses.replace(spec, q_offset=s - t), q_lengths, kv_lengths
  if t == 1 and spec.left is None and spec.right is not None and spec.right >= 0:
    return MaskSpec(), q_lengths, kv_lengths  # the one query is the row's last: every valid key
  q_lengths = (jnp.full((b,), t, jnp.int32) if q_lengths is None
               else jnp.clip(q_lengths, 0, t).astype(jnp.int32))
  if kv_lengths is not None:
    kv_lengths = jnp.clip(kv_lengths, 0, s).astype(jnp.int32)
  return dataclasses.replace(spec, offset_from_lengths=True), q_lengths, kv_lengths


def _check_mods(score_mod, mask_mod, block_mask, shape_q, shape_k):
  """(score_mod, its captured arrays, mask_mod, its captured arrays, block
  mask), traced (`mod_functions.trace`) and checked against the call."""
  score_fn, score_captured = (None, ())
  if score_mod is not None:
    score_fn, score_captured = mod_functions.trace(score_mod, "score_mod")
  mask_fn, mask_captured = (None, ())
  if mask_mod is not None:
    mask_fn, mask_captured = mod_functions.trace(mask_mod, "mask_mod")
  if block_mask is not None:
    if not isinstance(block_mask, BlockMask):
      raise ValueError("`block_mask` must come from fa4_jax.create_block_mask; got "
                       f"{type(block_mask).__name__}")
    (b, t, n), s = shape_q, shape_k[1]
    bm_b, bm_h, nq, nk = block_mask.shape
    want = (cdiv(t, block_mask.q_block), cdiv(s, block_mask.kv_block))
    if ((block_mask.q_len, block_mask.kv_len) != (t, s) or (nq, nk) != want
        or bm_b not in (1, b) or bm_h not in (1, n)):
      raise ValueError(
          f"`block_mask` was made for batch {bm_b}, heads {bm_h}, q_len {block_mask.q_len}, "
          f"kv_len {block_mask.kv_len}; this call has batch {b}, {n} query heads, q_len {t}, "
          f"kv_len {s} (batch and heads may be 1 in the block mask: it broadcasts)")
    if mask_fn is None:  # the block mask brings its mask_mod along
      mask_fn, mask_captured = block_mask.mask_mod, tuple(block_mask.mask_captured)
    if mask_fn is None:
      raise ValueError("`block_mask` carries no `mask_mod`; make it with "
                       "fa4_jax.create_block_mask(mask_mod, ...)")
  return score_fn, score_captured, mask_fn, mask_captured, block_mask


def validate(query, key, value, bias, mask, *, scale, is_causal,
             query_seq_lengths, key_value_seq_lengths, local_window_size,
             implementation, query_segment_ids=None,
             key_value_segment_ids=None, sinks=None, logits_soft_cap=None,
             causal_alignment="top_left", score_mod=None, mask_mod=None,
             block_mask=None, query_descale=None, key_descale=None, value_descale=None,
             output_dtype=None, value_head_dim=None) -> Arguments:
  if implementation not in IMPLEMENTATION_CHOICES:
    raise ValueError(
        f"`implementation` must be one of {IMPLEMENTATION_CHOICES}; got {implementation!r}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"`is_causal` must be a bool; got {is_causal!r}")
  query, key = as_array(query, "query"), as_array(key, "key")
  value_head_dim, value_descale = values_from_keys(value, value_head_dim, key.shape[-1],
                                                   key_descale, value_descale)
  value = as_array(value, "value") if value_head_dim is None else key[..., :value_head_dim]
  _check_qkv(query, key, value)
  output_shape = query.shape[:-1] + value.shape[-1:]
  rank = query.ndim
  if query.ndim == 3:
    query, key, value = query[None], key[None], value[None]
  b, t, n, h = query.shape
  s = key.shape[1]
  window = _check_window(local_window_size)
  q_ids, kv_ids = _check_segment_ids(query_segment_ids, key_value_segment_ids,
                                     (b, t), (b, s), rank)
  q_lengths = _check_lengths(query_seq_lengths, "query_seq_lengths", b, t, "the query length")
  kv_lengths = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s,
                              "the key/value length")
  spec, q_lengths, kv_lengths = _align(MaskSpec.from_arguments(bool(is_causal), window),
                                       causal_alignment, q_lengths, kv_lengths, b, t, s)
  mask = _check_pair_array(mask, "mask", (b, n, t, s), want_bool=True)
  score_fn, score_captured, mask_fn, mask_captured, block_mask = _check_mods(
      score_mod, mask_mod, block_mask, (b, t, n), (b, s))
  scores = Scores(
      mask=spec, scale=check_scale(scale, h), soft_cap=check_soft_cap(logits_soft_cap),
      score_mod=score_fn, mask_mod=mask_fn, q_lengths=q_lengths, kv_lengths=kv_lengths,
      q_segment_ids=q_ids, kv_segment_ids=kv_ids, sinks=check_sinks(sinks, n),
      score_captured=score_captured, mask_captured=mask_captured, block_mask=block_mask,
      q_descale=check_descale(query_descale, "query_descale", "query", query.dtype, n,
                               "query head"),
      k_descale=check_descale(key_descale, "key_descale", "key", key.dtype, key.shape[2],
                               "key/value head"),
      v_descale=check_descale(value_descale, "value_descale", "value", value.dtype,
                               key.shape[2], "key/value head"),
      out_dtype=check_output_dtype(output_dtype, query.dtype, key.dtype))
  return Arguments(
      query=query, key=key, value=value,
      bias=_check_pair_array(bias, "bias", (b, n, t, s), want_bool=False),
      mask=mask, scores=scores, output_shape=output_shape,
      values_from_keys=value_head_dim is not None)


# --- paged_attention ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedStatic:
  """A `paged_attention` call's compile-time constants."""

  score: ScoreFunction  # the scale and the soft-cap
  is_causal: bool
  output_dtype: object = None  # float8 pages: the output's dtype (validation)
  value_head_dim: int | None = None  # `value_pages=None`: the values are the keys' first ones

  def is_prefill(self, q_shape) -> bool:
    """Causal with several query tokens (chunked prefill): each row's band
    sits at its length."""
    return self.is_causal and q_shape[1] > 1

  def kernel_mask(self, q_shape) -> MaskSpec:
    """The kernels' mask: bottom-right causal aligned per row by the lengths
    (the queries' lengths are T) for chunked prefill, else no band."""
    return MaskSpec(right=0, offset_from_lengths=True) if self.is_prefill(q_shape) else MaskSpec()


@dataclasses.dataclass(frozen=True)
class PagedArguments:
  """Validated `paged_attention` arguments."""

  query: jax.Array
  key_pages: jax.Array
  value_pages: jax.Array
  page_table: jax.Array  # int32
  lengths: jax.Array  # int32
  sinks: jax.Array | None
  static: PagedStatic
  # float8: float32 descales of the query, keys and values (None: 1).
  descales: tuple = (None, None, None)
  # score_mod / mask_mod (None where not given), passed on to the XLA path.
  mods: dict = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def traced_mods(self) -> Scores | None:
    """`mods` traced, as the kernels take them (`sm90_decode.forward(...,
    mods=)`); None without. Traced once per call: the kernel's selection
    and the kernel itself read the same."""
    fns = {kind: fn for kind, fn in self.mods.items() if fn is not None}
    if not fns:
      return None
    parts = {}
    for kind, fn in fns.items():
      traced, captured = mod_functions.trace(fn, kind)
      parts[kind] = traced
      parts[f"{kind.split('_')[0]}_captured"] = captured
    return Scores(**parts)


def validate_paged(query, key_pages, value_pages, page_table, lengths, *, scale, is_causal,
                   sinks, logits_soft_cap, implementation, descales=(None, None, None),
                   output_dtype=None, value_head_dim=None, mods=None) -> PagedArguments:
  """Checks every argument of `fa4_jax.paged_attention` (the same names)."""
  if implementation not in PAGED_IMPLEMENTATION_CHOICES:
    raise ValueError(f"`implementation` must be one of {PAGED_IMPLEMENTATION_CHOICES}; "
                     f"got {implementation!r}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"`is_causal` must be a bool; got {is_causal!r}")
  query, key_pages = as_array(query, "query"), as_array(key_pages, "key_pages")
  if value_pages is not None:
    value_pages = as_array(value_pages, "value_pages")
  _check_page_pool(query, key_pages, value_pages)
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
  static = PagedStatic(score=ScoreFunction(check_scale(scale, query.shape[-1]),
                                           check_soft_cap(logits_soft_cap)),
                       is_causal=bool(is_causal), value_head_dim=value_head_dim,
                       output_dtype=check_output_dtype(output_dtype, query.dtype, key_pages.dtype))
  heads, kv_heads = query.shape[2], key_pages.shape[2]
  descales = tuple(
      check_descale(x, f"{name}_descale", operand, dtype, n, heads_name)
      for x, name, operand, dtype, n, heads_name in zip(
          descales, ("query", "key", "value"), ("query", "key_pages", "value_pages"),
          (query.dtype, key_pages.dtype, (key_pages if value_pages is None else value_pages).dtype),
          (heads, kv_heads, kv_heads),
          ("query head", "key/value head", "key/value head")))
  return PagedArguments(query, key_pages, value_pages, page_table, lengths,
                    check_sinks(sinks, heads), static, descales,
                    {k: v for k, v in (mods or {}).items() if v is not None})


def _check_page_pool(query, key_pages, value_pages) -> None:
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


def check_deterministic(deterministic, name: str = "deterministic", prefix: str = "") -> None:
  """`fa4_jax.attention(deterministic=...)` (and Flax's
  `deterministic_backward`) must be a Python bool: it is static, it picks
  the backward's kernels when the call is traced."""
  if not isinstance(deterministic, (bool, np.bool_)):
    raise ValueError(f"{prefix}`{name}` must be True or False (a Python bool); got "
                     f"{deterministic!r}")
