"""`fa4_jax.attention`: a drop-in for `jax.nn.dot_product_attention`."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from fa4_jax import backends, mod_functions, scores
from fa4_jax.validation import Arguments, check_deterministic, validate
from fa4_jax.vjp import CoreConfig, attention_core, current_matmul_precision

Implementation = Literal["xla", "sm90", "sm100", "cudnn"] | None


def attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation = None,
    return_residual: bool = False,
    query_segment_ids=None,
    key_value_segment_ids=None,
    sinks=None,
    logits_soft_cap: float | None = None,
    causal_alignment: str = "top_left",
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    query_descale=None,
    key_descale=None,
    value_descale=None,
    output_dtype=None,
    value_head_dim=None,
    deterministic: bool = True,
):
  """Scaled dot-product attention, `softmax(scale * Q K^T + bias) V`.

  Same arguments and semantics as `jax.nn.dot_product_attention` (jax 0.11.2):

  Args:
    query: `[B, T, N, H]` or `[T, N, H]`; bfloat16, float16, float32 or float64.
    key, value: `[B, S, K, H]` or `[S, K, H]`, same dtype as `query`;
      `N % K == 0` (GQA; `K == 1` is MQA). The value's head dim may differ
      from the query's and key's (`[B, S, K, Hv]`, e.g. 128 against 192):
      the output's is the value's. `value=None` with `value_head_dim=Hv`:
      the values are the keys' first `Hv` features (MLA's latent cache).
    bias: optional additive bias, rank <= 4, broadcastable to `[B, N, T, S]`.
      Differentiable.
    mask: optional boolean array (True = attend), broadcastable to `[B, N, T, S]`.
    scale: logit scale; default `1 / sqrt(H)`. A Python number.
    is_causal: query `i` sees keys `j <= i` (aligned top-left, as `jax.nn`
      does, also when `T != S`).
    query_seq_lengths: int32 `[B]`; output rows at or past the length are 0.
    key_value_seq_lengths: int32 `[B]`; keys at or past the length are ignored.
    local_window_size: `w` or `(left, right)`: query `i` sees keys
      `i - left <= j <= i + right`.
    implementation: `None` (best available for this device, never raises for
      lack of a kernel), `"xla"` (any device), `"sm90"` (Hopper kernel),
      `"sm100"` (Blackwell kernel), or `"cudnn"` (forwarded to
      `jax.nn.dot_product_attention`). A kernel that cannot serve the
      arguments or the device raises a `ValueError` that says why. The
      choice is made when the call is traced, for the default device, or
      for the GPU named by `fa4_jax.gpu_target` (export and AOT lowering
      from a host without that GPU).
    return_residual: also return the log-sum-exp of the logits, shape
      `[B, T, N]` (`[T, N]` for rank-3 inputs), under `stop_gradient`.
    query_segment_ids, key_value_segment_ids: integer `[B, T]` and `[B, S]`
      (`[T]` and `[S]` for rank-3 inputs), both or neither: packed sequences.
      A query sees a key only when their ids are equal, on top of every
      other mask. Any integer values; ids need not be sorted, but documents
      packed as contiguous runs are the fast case: the kernels skip the key
      tiles a query tile's ids cannot meet, and only tiles on a document
      boundary pay for the element mask. Not part of `jax.nn`'s signature.
    sinks: optional float `[N]`, one logit per query head (under GQA too):
      attention sinks (gpt-oss, StreamingLLM). Each row's softmax gains a
      virtual key with logit `sinks[n]` (in the units of the scaled logits)
      and a zero value: `out = sum_j exp(s_j) v_j / (exp(sink) + sum_j
      exp(s_j))`. Differentiable. The residual (`return_residual=True`)
      includes the sink; a row that sees no key gets zeros and a residual of
      `sink`. Not part of `jax.nn`.
    logits_soft_cap: optional positive Python number `cap`: the scaled (and
      biased) logits become `cap * tanh(logits / cap)` before masking and
      the softmax (Gemma 2). Not part of `jax.nn`.
    causal_alignment: where `is_causal` and `local_window_size` put the
      diagonal. `"top_left"` (default, `jax.nn`'s): query `i` sits at
      position `i`. `"bottom_right"`: the queries are the last tokens of
      each row's context, so each batch row's last valid query (by
      `query_seq_lengths`, else `T`) is aligned with its last valid key (by
      `key_value_seq_lengths`, else `S`): query `i` sits at position
      `i + kv_len - q_len`. This is the mask of decoding and of chunked
      prefill against a KV cache. Every backend takes it, forward and
      backward: without lengths it is a fixed shift; with lengths each row
      has its own (`kv_len - q_len`), which the kernels read per row; a
      one-token causal query with lengths sees every valid key (the decode
      arrangement). Not part of `jax.nn`.
    score_mod: optional `score_mod(score, batch, head, q_idx, kv_idx) ->
      score`, FlexAttention's contract: a JAX function of a float32 score and
      int32 indices, applied elementwise to the scaled (and biased) score
      before the soft-cap and the masks. `head` is the query head; `q_idx`
      and `kv_idx` are positions in the query and key sequences as passed
      (under bottom-right alignment too). It may close over arrays (ALiBi
      slopes, a bias table): gradients flow to them. Fused into the kernels;
      one that uses an op a kernel cannot run falls back to the XLA path
      (`implementation="sm90"` raises a ValueError naming the op).
    mask_mod: optional `mask_mod(batch, head, q_idx, kv_idx) -> bool` (True:
      attend), and-ed with every other mask. Without `block_mask`, the call
      classifies its tiles itself (evaluating `mask_mod` once per call).
    block_mask: optional, from `fa4_jax.create_block_mask`: the tile classes
      of a `mask_mod` computed once and reused across layers and calls (its
      `mask_mod` applies when `mask_mod` is not given).
    query_descale, key_descale, value_descale: float8 inputs (`query`, `key`
      and `value` all `float8_e4m3fn` or all `float8_e5m2`, or a bfloat16 /
      float16 query with float8 keys and values: a float8 KV cache): the
      real value is the stored one times its descale, a float32 scalar or
      one factor per head (`[N]` for the query, `[K]` for keys and values);
      None is 1. Only for float8 operands. Inference only: differentiating
      a call with float8 operands raises a ValueError. Not part of `jax.nn`.
    value_head_dim: with `value=None` (only then), how many of each key's
      leading features are its value (float8 keys: dequantized by
      `key_descale`, so `value_descale` stays out). Not part of `jax.nn`.
    output_dtype: the output's dtype for float8 operands: bfloat16 (default
      for a float8 query; a bfloat16 / float16 query's own dtype otherwise),
      float16 or float32. Not part of `jax.nn`.
    deterministic: `True` (default): the gradients are bit-identical from
      run to run (every backward kernel writes each gradient element from
      one place, in a fixed order). `False`: the sm90 (Hopper) backward may
      run its one-kernel variant, which adds dQ in float32 from every key
      tile by TMA reduce-adds in arrival order (as cuDNN's and
      FlashAttention's default backwards do): dQ may differ in its last bits
      between runs; dK and dV stay deterministic. It serves head dims that
      pad to 128 with a value head dim as wide, every built-in mask,
      lengths, GQA, segment ids and soft-cap, and runs where it measured
      faster than the two deterministic kernels (dense rows of 4096 keys or
      more, causal rows of 16384 or more without GQA); elsewhere (shorter
      rows, windows, causal GQA, other head dims, a `score_mod` /
      `mask_mod`) the deterministic kernels run. It changes
      nothing on the XLA path, the sm100 backward, context-parallel ring
      steps or `implementation="cudnn"` (XLA's flags decide cuDNN's). A
      Python bool. Not part of `jax.nn`.

  Returns:
    The attention output, shaped like `query` but for its head dim, the
    value's (and the residual, if asked).

  One deliberate difference from `jax.nn`: a query row that may see no key at
  all (for example `key_value_seq_lengths == 0`) gets zeros and a residual of
  `-inf`, where `jax.nn`'s XLA path returns the mean of all values.

  New keyword-only arguments will be added after these, so positional and
  keyword callers keep working.
  """
  named = _validated_arguments(locals())
  check_deterministic(deterministic)
  if implementation == "cudnn":
    given = [name for name in _NOT_IN_JAX_NN if named[name] is not None]
    if causal_alignment != "top_left":
      given.append("causal_alignment")
    if given:
      raise ValueError(
          "implementation='cudnn' forwards to jax.nn.dot_product_attention, which has no "
          f"{', '.join(f'`{n}`' for n in given)}; use implementation=None")
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="cudnn",
        return_residual=return_residual)

  args, backend = _prepare(query, key, value, bias, mask, implementation, **named)
  config = CoreConfig(backend=backend, matmul_precision=current_matmul_precision(),
                      deterministic=deterministic)
  out, lse = attention_core(args.query, args.key, args.value, args.bias, args.mask,
                            args.scores, config)
  out = out.reshape(args.output_shape)
  if not return_residual:
    return out
  # [B, N, T] -> [B, T, N], in the inputs' dtype as jax.nn returns it (the
  # output's, for float8 inputs).
  lse = lax.stop_gradient(lse).transpose(0, 2, 1).astype(args.scores.out_dtype or args.key.dtype)
  return out, lse.reshape(args.output_shape[:-1])


def which_implementation(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
    implementation: Implementation = None, query_segment_ids=None,
    key_value_segment_ids=None, sinks=None, logits_soft_cap=None,
    causal_alignment="top_left", score_mod=None, mask_mod=None, block_mask=None,
    query_descale=None, key_descale=None, value_descale=None, output_dtype=None,
    value_head_dim=None, part: str = "forward",
) -> str:
  """The implementation `attention` would use for these arguments here (on
  the default device, or for the active `fa4_jax.gpu_target`):
  `"xla"`, `"sm90"`, `"sm90_decode"` (the sm90 kernels in their decode
  arrangement: short queries without a band mask, see
  `fa4_jax.kernels.sm90_decode`), `"sm100"` or `"cudnn"`. Raises as `attention` would.

  `part="backward"`: what computes the gradients instead: a kernel family's
  fused backward (`"sm90"`, `"sm100"`), or `"xla"` where the kernel has none
  for these arguments (then the XLA backward runs on the kernel's
  log-sum-exp), or `"cudnn"`."""
  named = _validated_arguments(locals())
  if part not in ("forward", "backward"):
    raise ValueError(f"part must be 'forward' or 'backward'; got {part!r}")
  if implementation == "cudnn":
    return "cudnn"
  args, backend = _prepare(query, key, value, bias, mask, implementation, **named)
  if part == "backward":
    return backends.backward_name(backend, _call_info(args))
  return backend.name


# The keyword arguments of `attention` and `which_implementation` that
# `validate` takes, by name (`tests/test_api_surface.py` checks both
# signatures against this list), and those jax.nn has no counterpart of.
_VALIDATED = ("scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths",
              "local_window_size", "query_segment_ids", "key_value_segment_ids", "sinks",
              "logits_soft_cap", "causal_alignment", "score_mod", "mask_mod", "block_mask",
              "query_descale", "key_descale", "value_descale", "output_dtype",
              "value_head_dim")
_NOT_IN_JAX_NN = ("query_segment_ids", "key_value_segment_ids", "sinks", "logits_soft_cap",
                  "score_mod", "mask_mod", "block_mask", "query_descale", "key_descale",
                  "value_descale", "output_dtype", "value_head_dim")


def _validated_arguments(local_vars) -> dict:
  """`validate`'s keyword arguments from a public function's `locals()`."""
  return {name: local_vars[name] for name in _VALIDATED}


def _prepare(query, key, value, bias, mask, implementation, **named):
  """The validated arguments (`named`: `validate`'s keyword arguments) and
  the backend that serves them."""
  args: Arguments = validate(query, key, value, bias, mask, implementation=implementation,
                             **named)
  return args, backends.select(implementation, _call_info(args))


def _call_info(args: Arguments) -> backends.CallInfo:
  return backends.CallInfo.of(args.query, args.key, args.bias, args.mask, args.scores,
                              args.value, values_from_keys=args.values_from_keys)


def create_block_mask(mask_mod, batch: int | None, heads: int | None, q_len: int,
                      kv_len: int, *, q_block: int = scores.DEFAULT_MASK_BLOCK,
                      kv_block: int = scores.DEFAULT_MASK_BLOCK) -> scores.BlockMask:
  """The tile classes of `mask_mod(batch, head, q_idx, kv_idx) -> bool`,
  computed once in XLA, for `fa4_jax.attention(..., block_mask=)`.

  Every (query tile, key tile) pair of `q_block` x `kv_block` positions is
  EMPTY (no pair visible: never loaded), PARTIAL (the element mask runs) or
  FULL (every pair visible: `mask_mod` is not evaluated there). `batch` /
  `heads` None: the mask is the same for every batch row / head (it is
  evaluated at index 0 and broadcast; the classes' axis is 1). Given a
  number where `mask_mod` provably ignores that index (no data flow from
  it to the result), it is still evaluated at one row / head only, and the
  classes are that one broadcast to the shape asked for, so `classes` is
  [batch, heads, ...] as asked either way. Reusable across layers and calls,
  under `jit` too (it is a pytree of arrays); a kernel whose tiles differ
  from `q_block` x `kv_block` regroups it where the sizes nest, else
  evaluates `mask_mod` anew."""
  mod, captured = mod_functions.trace(mask_mod, "mask_mod")
  for name, value in (("q_len", q_len), ("kv_len", kv_len), ("q_block", q_block),
                      ("kv_block", kv_block)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be a positive int; got {value!r}")
  for name, value in (("batch", batch), ("heads", heads)):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"`{name}` must be a positive int or None (broadcast); got {value!r}")
  shape = (batch or 1, heads or 1)
  at = scores.broadcast_extents(mod, *shape)
  classes = scores.mask_mod_classes(mod, captured, *at, q_len, kv_len, q_block, kv_block)
  if at != shape:
    classes = jnp.broadcast_to(classes, shape + classes.shape[2:])
  return scores.BlockMask(classes=classes, mask_captured=captured, q_block=q_block,
                          kv_block=kv_block, q_len=q_len, kv_len=kv_len, mask_mod=mod)
