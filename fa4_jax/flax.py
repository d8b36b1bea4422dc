"""fa4_jax as the `attention_fn` of Flax's attention modules.

Flax's `nnx.MultiHeadAttention` and linen's `nn.MultiHeadDotProductAttention`
call their `attention_fn` with Flax's own argument names (`mask`,
`dropout_rate`, `deterministic`, `dtype`, `precision`, `module`, ...), not
`jax.nn.dot_product_attention`'s. This module translates them:

    from flax import nnx
    import fa4_jax.flax

    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
        attention_fn=fa4_jax.flax.attention_fn)
    y = layer(x, is_causal=True)          # NNX passes is_causal through

    # linen has no `is_causal` call argument: fix it in the function instead.
    layer = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=fa4_jax.flax.make_attention_fn(is_causal=True))

How each Flax argument is handled:

* `mask` (True = attend; any dtype, nonzero = attend, as in Flax) and `bias`
  (additive) are passed on, broadcastable to `[batch..., heads, q, kv]`.
  A mask *array* keeps the GPU kernels from serving the call (they take only
  `is_causal` / `local_window_size` and key lengths), so prefer
  `is_causal=True` over `nn.make_causal_mask(...)` where you can; a mask
  that only marks each row's valid keys as a prefix runs as key lengths
  (cached decoding, below).
* `is_causal` (NNX call argument) is passed on; `make_attention_fn(
  is_causal=True)` adds it to every call.
* `dtype`: query, key and value are cast to it, as Flax does; with
  `dtype=None` they are promoted to their common dtype.
* `dropout_rate > 0` with `deterministic=False`: a `ValueError`. Flash
  attention never forms the attention weights, so there is nothing to drop;
  use dropout elsewhere in the model, or Flax's default `attention_fn`.
* `module` (Flax's `sow_weights=True`): a `ValueError`, for the same reason.
* `precision`: `None` or `DEFAULT` only, unless `make_attention_fn(
  ignore_precision=True)`. fa4_jax always accumulates in float32 and its
  softmax runs in float32; its matmuls take the inputs in their own dtype.
* `force_fp32_for_softmax`: accepted either way (the softmax is float32).
* `qk_attn_weights_einsum`, `attn_weights_value_einsum`, `einsum_dot_general`
  (custom/quantized einsums): a `ValueError` unless None.
* Leading batch dimensions: none, one or several (they are flattened).
* `sinks` ([heads], a parameter the model holds itself) is an argument of
  `attention_fn`, and so are `query_descale`, `key_descale` and
  `value_descale` (float8 inputs, as in `fa4_jax.attention`: a float8 key
  and value keep their dtype unless `dtype` is given); `make_attention_fn(logits_soft_cap=cap)` soft-caps every
  call.
* Segment ids (packed sequences): Flax's modules pass no such argument to
  their `attention_fn`, so there are two routes. Code that calls
  `attention_fn` itself passes `query_segment_ids=` and
  `key_value_segment_ids=` (`[batch..., q_length]`, `[batch..., kv_length]`).
  Around a stock Flax module, `with fa4_jax.flax.segment_ids(q_ids, kv_ids):`
  applies them to every `attention_fn` call traced inside the block; enter it
  inside the function you `jax.jit`, with the ids as its arguments:

      @jax.jit
      def forward(model, x, ids):
        with fa4_jax.flax.segment_ids(ids, ids):
          return model(x, is_causal=True)

Cached decoding (`decode=True`): Flax passes its cache mask, `[batch..., 1,
1, max_length]` (the keys written so far), and `is_causal=False`. A mask of
that form (one per batch row, the same for every head and query: also a
padding mask) whose rows are prefixes of the keys runs as
`key_value_seq_lengths`, which the GPU kernels serve (one token: the decode
arrangement); rows that are not prefixes run the mask, on the XLA path.
With a traced mask (under `jax.jit`) the choice is a `lax.cond` on the
mask's values, so both are compiled.

One difference from Flax's default: a query row whose every key is masked
gets zeros (Flax and `jax.nn` return the mean of all values).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.numpy as jnp

from fa4_jax import api, validation
from fa4_jax.scores import FP8_DTYPES

_PREFIX = "fa4_jax.flax.attention_fn"
_context = threading.local()


@contextlib.contextmanager
def segment_ids(query_segment_ids, key_value_segment_ids):
  """Packed sequences for the Flax modules called inside the block: every
  `fa4_jax.flax` `attention_fn` traced there gets these segment ids
  (`[batch..., q_length]` and `[batch..., kv_length]`, as the module's
  inputs), unless the call passes its own. Enter it inside the jitted
  function, with the ids as arguments: ids fixed outside a trace would be
  baked into it (that raises)."""
  previous = getattr(_context, "segment_ids", None)
  _context.segment_ids = (query_segment_ids, key_value_segment_ids)
  try:
    yield
  finally:
    _context.segment_ids = previous


def make_attention_fn(*, is_causal: bool = False, local_window_size=None,
                      implementation: api.Implementation = None,
                      ignore_precision: bool = False, logits_soft_cap: float | None = None,
                      causal_alignment: str = "top_left", score_mod=None, mask_mod=None,
                      block_mask=None, deterministic_backward: bool = True):
  """An `attention_fn` for Flax's attention modules with fixed fa4_jax options.

  Args:
    is_causal: apply a causal mask on every call (in addition to the call's own
      `is_causal`). Aligned top-left, the query and key lengths must be
      equal: during Flax's cached decoding (`decode=True`, one query against
      the whole cache) a causal mask aligned top-left would hide every key
      but the first, so that raises; Flax's decode mask already does the job
      there, or use `causal_alignment="bottom_right"`.
    local_window_size: passed to `fa4_jax.attention` (sliding window).
    implementation: passed to `fa4_jax.attention` (`None` picks the best).
    ignore_precision: accept any Flax `precision` (it then only affects
      Flax's projections, not the attention).
    logits_soft_cap: passed to `fa4_jax.attention` on every call (Gemma 2's
      `cap * tanh(logits / cap)`).
    causal_alignment: passed to `fa4_jax.attention` on every call
      (`"bottom_right"`: the queries are the last tokens of the context).
    score_mod, mask_mod, block_mask: passed to `fa4_jax.attention` on every
      call (programmable attention: ALiBi, prefix-LM, ...). With several
      leading batch dims, `batch` is the index into them flattened.
    deterministic_backward: `fa4_jax.attention`'s `deterministic` on every
      call (`False`: the sm90 backward may sum dQ in float32 in arrival
      order, a one-kernel backward). Named apart from Flax's own
      `deterministic`, which is about dropout.

  Returns:
    A function with Flax's `attention_fn` signature.
  """
  options = dict(always_causal=is_causal, local_window_size=local_window_size,
                 implementation=implementation, ignore_precision=ignore_precision,
                 logits_soft_cap=logits_soft_cap, causal_alignment=causal_alignment,
                 score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                 deterministic_backward=deterministic_backward)
  validation.check_deterministic(deterministic_backward, "deterministic_backward",
                                 prefix=f"{_PREFIX}: ")

  # Every argument is named, not swallowed by **kwargs: linen passes only the
  # keyword arguments that appear in the function's signature.
  def attention_fn(query, key, value, bias=None, mask=None,
                   broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
                   deterministic=False, dtype=None, precision=None, module=None,
                   force_fp32_for_softmax=False, einsum_dot_general=None,
                   qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                   promote_dtype=None, is_causal=False, query_segment_ids=None,
                   key_value_segment_ids=None, sinks=None, query_descale=None,
                   key_descale=None, value_descale=None, **unsupported):
    """Flax `attention_fn` computed by `fa4_jax.attention`.

    Takes Flax's `dot_product_attention` arguments (see `fa4_jax.flax`).
    """
    del broadcast_dropout, dropout_rng, force_fp32_for_softmax
    call = _translate(
        query, key, value, bias, mask, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=dtype, precision=precision,
        module=module, einsum_dot_general=einsum_dot_general,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
        promote_dtype=promote_dtype, is_causal=is_causal,
        segment_ids=_segment_ids_of_call(query, query_segment_ids, key_value_segment_ids),
        sinks=sinks, descales=(query_descale, key_descale, value_descale),
        unsupported=unsupported, **options)
    out = _attend(call)
    return out.reshape(call.batch_shape + out.shape[-3:])

  attention_fn.options = options  # what which_implementation needs to know
  return attention_fn


attention_fn = make_attention_fn()
attention_fn.__doc__ = """Flax `attention_fn` computed by `fa4_jax.attention`
(default options; see `make_attention_fn` for causal/window/implementation)."""


def which_implementation(query, key, value, bias=None, mask=None, *,
                         attention_fn=attention_fn, dtype=None, is_causal=False,
                         query_segment_ids=None, key_value_segment_ids=None):
  """The implementation (`"xla"`, `"sm90"`, ...) `attention_fn` would use for
  these Flax arguments (query/key/value as Flax passes them to it)."""
  call = _translate(query, key, value, bias, mask, dtype=dtype,
                    is_causal=is_causal,
                    segment_ids=_segment_ids_of_call(query, query_segment_ids,
                                                     key_value_segment_ids),
                    **attention_fn.options)
  keys = _key_mask_as_lengths(call)
  if keys is None:
    return api.which_implementation(*call.arrays, **call.kwargs)
  by_lengths, by_mask, prefix = keys
  # A traced mask: what serves it when its rows are prefixes.
  return (by_mask if _known_false(prefix) else by_lengths)(api.which_implementation)


def _segment_ids_of_call(query, query_segment_ids, key_value_segment_ids):
  """The call's own segment ids, else those of an enclosing `segment_ids`
  block, else None."""
  if query_segment_ids is not None or key_value_segment_ids is not None:
    return query_segment_ids, key_value_segment_ids
  ids = getattr(_context, "segment_ids", None)
  if ids is None:
    return None, None
  if isinstance(query, jax.core.Tracer) and not any(
      isinstance(x, jax.core.Tracer) for x in ids):
    raise ValueError(
        "fa4_jax.flax.segment_ids: the ids are fixed arrays but the model is being "
        "traced (jax.jit): they would be baked into the compiled function and "
        "reused for other ids. Enter the block inside the jitted function, "
        "with the ids as its arguments")
  return ids


def _attend(call):
  """`fa4_jax.attention` of a translated call. A mask that only says which
  keys each batch row holds, as prefixes (`_key_mask_as_lengths`), runs as
  key lengths, which the kernels serve: decided in Python for a concrete
  mask, by `lax.cond` for a traced one (both branches are compiled; the
  predicate is a reduction over [batch, kv_length])."""
  attention = functools.partial(api.attention, deterministic=call.deterministic)
  keys = _key_mask_as_lengths(call)
  if keys is None:
    return attention(*call.arrays, **call.kwargs)
  by_lengths, by_mask, prefix = keys
  if not isinstance(prefix, jax.core.Tracer):
    return (by_lengths if bool(prefix) else by_mask)(attention)
  return jax.lax.cond(prefix, lambda: by_lengths(attention), lambda: by_mask(attention))


def _key_mask_as_lengths(call):
  """For a mask of shape [batch or 1, 1, 1, kv_length] (no bias): Flax's
  cached-decoding mask (keys 0..index), a padding mask. Returns (the call
  with key lengths instead, the call with the mask, whether every row's
  keys are a prefix), each call taking `api.attention` or
  `api.which_implementation`; None for any other mask. The mask's call runs
  the XLA path when a kernel was named (no kernel takes a mask)."""
  query, key, value, bias, mask = call.arrays
  if (mask is None or bias is not None or mask.ndim != 4 or query.ndim != 4
      or mask.shape[1:3] != (1, 1)):
    return None
  batch, kv_length = query.shape[0], key.shape[1]
  valid = jnp.broadcast_to(mask[:, 0, 0, :], (batch, kv_length))
  lengths = jnp.sum(valid, axis=-1, dtype=jnp.int32)
  prefix = jnp.all(valid == (jnp.arange(kv_length) < lengths[:, None]))
  mask_kwargs = dict(call.kwargs)
  if mask_kwargs.get("implementation") not in (None, "xla"):
    mask_kwargs["implementation"] = "xla"
  return (lambda f: f(query, key, value, key_value_seq_lengths=lengths, **call.kwargs),
          lambda f: f(query, key, value, mask=mask, **mask_kwargs),
          prefix)


def _known_false(x) -> bool:
  return not isinstance(x, jax.core.Tracer) and not bool(x)


class _FlaxCall:
  """`fa4_jax.attention` arguments, with leading batch dims flattened to one."""

  def __init__(self, arrays, kwargs, batch_shape, deterministic: bool = True):
    self.arrays = arrays  # query, key, value, bias, mask
    self.kwargs = kwargs  # those `which_implementation` takes too
    self.batch_shape = batch_shape  # the query's leading dims, restored after
    self.deterministic = deterministic  # `attention`'s alone


def _translate(query, key, value, bias, mask, *, dropout_rate=0.0,
               deterministic=True, dtype=None, precision=None, module=None,
               einsum_dot_general=None, qk_attn_weights_einsum=None,
               attn_weights_value_einsum=None, promote_dtype=None,
               is_causal=False, segment_ids=(None, None), sinks=None,
               descales=(None, None, None), unsupported=None,
               always_causal=False, logits_soft_cap=None,
               local_window_size=None, causal_alignment="top_left",
               implementation=None, ignore_precision=False, score_mod=None, mask_mod=None,
               block_mask=None, deterministic_backward=True) -> _FlaxCall:
  """Checks Flax's arguments and maps them onto `fa4_jax.attention`'s."""
  _check_supported(dropout_rate, deterministic, precision, module,
                   einsum_dot_general, qk_attn_weights_einsum,
                   attn_weights_value_einsum, unsupported, ignore_precision)

  # dtype: Flax casts query, key and value to `dtype` (or to their common one);
  # a float8 key and value (a float8 KV cache) stay float8 unless `dtype` is
  # given (`fa4_jax.attention` checks the pairs it takes).
  if dtype is None and jnp.dtype(key.dtype) in FP8_DTYPES:
    pass
  elif promote_dtype is not None:  # NNX's hook, called the way NNX calls it
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  else:
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))

  # Shapes: Flax allows any number of leading batch dims, fa4_jax zero or one.
  if query.ndim < 3 or query.ndim != key.ndim or key.ndim != value.ndim:
    raise ValueError(
        f"{_PREFIX}: query, key and value must have the same rank, at least 3 "
        f"([batch..., length, heads, head_dim]); got shapes {query.shape}, "
        f"{key.shape} and {value.shape}")
  batch_shape = query.shape[:-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    raise ValueError(
        f"{_PREFIX}: query, key and value must have the same batch dims; got "
        f"shapes {query.shape}, {key.shape} and {value.shape}")
  q_ids, kv_ids = (_ids_array(x, name, batch_shape, length) for x, name, length in
                   zip(segment_ids, ("query_segment_ids", "key_value_segment_ids"),
                       (query.shape[-3], key.shape[-3])))
  if len(batch_shape) > 1:
    query, key, value = (x.reshape((-1,) + x.shape[-3:]) for x in (query, key, value))
  bias = _pair_array(bias, "bias", batch_shape)
  mask = _pair_array(mask, "mask", batch_shape)
  if mask is not None and mask.dtype != jnp.bool_:
    mask = mask.astype(jnp.bool_)  # Flax's masks may be float 0/1

  if always_causal and query.shape[-3] != key.shape[-3] and causal_alignment == "top_left":
    raise ValueError(
        f"{_PREFIX}: make_attention_fn(is_causal=True) needs equal query and key "
        f"lengths, got {query.shape[-3]} and {key.shape[-3]}. With Flax's cached "
        "decoding (decode=True) the causal mask would hide all but the first "
        "cached key; there, leave is_causal to the module (NNX: "
        "layer(x, is_causal=True)), pass a mask, or use "
        "make_attention_fn(causal_alignment='bottom_right')")
  return _FlaxCall((query, key, value, bias, mask),
               dict(is_causal=bool(is_causal) or always_causal,
                    local_window_size=local_window_size,
                    implementation=implementation,
                    query_segment_ids=q_ids, key_value_segment_ids=kv_ids,
                    sinks=sinks, logits_soft_cap=logits_soft_cap,
                    query_descale=descales[0], key_descale=descales[1],
                    value_descale=descales[2],
                    causal_alignment=causal_alignment, score_mod=score_mod,
                    mask_mod=mask_mod, block_mask=block_mask),
               batch_shape, deterministic=deterministic_backward)


def _ids_array(x, name, batch_shape, length):
  """Segment ids [batch..., length] -> fa4_jax's [batch, length] ([length]
  without batch dims)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape != batch_shape + (length,):
    raise ValueError(
        f"{_PREFIX}: `{name}` shape must be the inputs' [batch..., length] = "
        f"{batch_shape + (length,)}; got {x.shape}")
  return x.reshape((-1, length)) if len(batch_shape) > 1 else x


def _pair_array(x, name, batch_shape):
  """A Flax mask/bias, broadcastable to [batch..., heads, q, kv], made
  broadcastable to fa4_jax's [batch, heads, q, kv] (or [heads, q, kv])."""
  if x is None:
    return None
  x = jnp.asarray(x)
  rank = len(batch_shape) + 3
  if x.ndim > rank:
    raise ValueError(
        f"{_PREFIX}: `{name}` has rank {x.ndim}, more than the "
        f"[batch..., heads, q_length, kv_length] = rank {rank} it must "
        f"broadcast to; got shape {x.shape}")
  if len(batch_shape) <= 1:
    return x  # fa4_jax broadcasts it the same way
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  if all(d == 1 for d in x.shape[:len(batch_shape)]):
    return x.reshape((1,) + x.shape[len(batch_shape):])
  x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
  return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def _check_supported(dropout_rate, deterministic, precision, module,
                     einsum_dot_general, qk_attn_weights_einsum,
                     attn_weights_value_einsum, unsupported, ignore_precision):
  """Raises for the Flax arguments fa4_jax cannot honour."""
  if unsupported:
    raise TypeError(
        f"{_PREFIX} got arguments it does not support: {sorted(unsupported)}. "
        "(input_positions is for Flax's RoPE attention function; apply RoPE "
        "to the query and key before attention instead)")
  if dropout_rate and not deterministic:
    raise ValueError(
        f"{_PREFIX}: attention dropout is not supported (dropout_rate="
        f"{dropout_rate}, deterministic=False): flash attention never forms the "
        "attention weights, so it cannot drop them. Use dropout_rate=0 (dropout "
        "elsewhere in the model works), deterministic=True, or Flax's default "
        "attention_fn")
  if module is not None:
    raise ValueError(
        f"{_PREFIX}: cannot sow attention weights (sow_weights=True): flash "
        "attention never forms them. Use Flax's default attention_fn to inspect them")
  for name, value in (("einsum_dot_general", einsum_dot_general),
                      ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                      ("attn_weights_value_einsum", attn_weights_value_einsum)):
    if value is not None:
      raise ValueError(
          f"{_PREFIX}: `{name}` (a custom or quantized einsum) is not supported; "
          "fa4_jax computes attention with its own matmuls")
  if not ignore_precision and not _is_default_precision(precision):
    raise ValueError(
        f"{_PREFIX}: precision={precision!r} is not supported: fa4_jax multiplies "
        "the inputs in their own dtype with float32 accumulation and a float32 "
        "softmax. Use precision=None, or make_attention_fn(ignore_precision=True) "
        "to keep the precision for Flax's projections only")


def _is_default_precision(precision) -> bool:
  if precision is None:
    return True
  if isinstance(precision, (tuple, list)):
    return all(_is_default_precision(p) for p in precision)
  if isinstance(precision, str):
    return precision.lower() == "default"
  return precision == jax.lax.Precision.DEFAULT
