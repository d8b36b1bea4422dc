"""Pallas Mosaic GPU kernels.

Every kernel module offers the same two functions, which `fa4_jax.backends`
plugs into the shared `jax.custom_jvp` (see `fa4_jax/vjp.py`):

    check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None
        Raises `KernelUnsupported` (a ValueError) with a message naming the
        argument and what the kernel expects when it cannot serve the call.

    forward(q, k, v, q_lengths, kv_lengths, *, score, mask, segment_ids=None)
            -> (out, lse)
        q: [B, Tq, Nq, D]; k, v: [B, Tk, Nkv, D]; Nq % Nkv == 0.
        q_lengths, kv_lengths: int32[B] or None.
        score: `scores.ScoreFunction`, how a raw q.k becomes a logit (the
             softmax scale, and the built-in modifications: see
             "score_function" below).
        segment_ids: None or (q_ids int32 [B, Tq], kv_ids int32 [B, Tk]): a
             row sees a key only when their ids are equal; key tiles whose
             ids cannot meet a tile's are skipped (`scores.segment_tile_ranges`).
        out: [B, Tq, Nq, D] in q.dtype; rows at or past q_lengths are zeros,
             and so are rows that see no key.
        lse: float32 [B, Nq, Tq], natural-log log-sum-exp of the scaled,
             masked logits; -inf where a row sees no key.

A backward module offers `backward(q, k, v, out, lse, dout, q_lengths,
kv_lengths, *, score, mask, segment_ids=None) -> (dq, dk, dv)` with the same
conventions.

Optional arguments, taken by a module that names them in its `FEATURES`
(a frozenset of strings; `fa4_jax.backends` passes them only when set):

    "sinks" (forward): sinks=float32 [Nq], this head's sink logit (natural
        log). The softmax starts from it (`scores.initial_row_stats(sink=)`):
        the lse includes it; a row that sees no key gets zeros and lse = sink;
        rows at or past q_lengths keep zeros and -inf.
    "score_function" (forward, backward): the module forms every logit
        through its `score` (`ScoreFunction.exp2_constant`, `logits`,
        `slope`, `needs_raw_scores`, ...), so it serves a score function that
        modifies the logits (`ScoreFunction.modifies_logits`: the soft-cap);
        without it, only the scale. What a call needs: `Scores.kernel_features`.
    "mods" (forward, backward): mods=the call's `scores.Scores` where it has
        a `score_mod` and / or a `mask_mod` (None otherwise): `score_mod`
        applied to the scaled score before the built-in modifications, `mask_mod` and-ed
        with the built-in masks, the tiles walked from `scores.block_lists`
        (empty tiles never loaded, full ones unmasked), the mods evaluated on
        a tile by `mod_functions` (`bind`, `evaluate_in_kernel`); the
        backward's dS times the score_mod's slope (`value_and_slope`). The
        sm90 kernels run a score_mod a * x + R(q_idx) + C(kv_idx) in its
        affine form (`mod_functions.affine_form`, `mod_tiles.affine_logits`). The
        gradients of the arrays the mods capture come from one XLA pass
        after the kernel backward (`fa4_jax.backends`).
    "value_head_dim" (forward, backward): v (and the output) may have a head
        dim of their own, up to 256. A backward module with it offers
        `check_value_head_dim(head_dim, value_head_dim)` (raises
        KernelUnsupported for pairs it does not take, which `fa4_jax.backends`
        then pads to one head dim); its out, dout and dv have v's head dim.
    "fp8" (forward): q, k and v may be float8 (all three), with
        descales=(q_descale f32 [Nq] or None, k_descale [Nkv] or None,
        v_descale [Nkv] or None), each operand's real value being the stored
        one times its descale, and out_dtype (the output's dtype). The
        module's `fp8_mode` says which float8 calls it takes.

`sm90_decode` is no kernel of its own but an arrangement of `sm90_forward`
for short queries against a long cache (query heads packed as rows, the
cache split into chunks, the chunks merged by their lse): it offers `plan`
and `forward(..., plan=)`, which `fa4_jax.backends` runs as "sm90_decode".
"""


def default_device():
  """The device a call runs on unless told otherwise: the one set with
  `jax.default_device(...)` (a device or a platform name), else the first
  device of the default backend. Backend selection checks its architecture
  and the persistent grids take its SM count, so a GPU machine asked to
  compute on its CPU gets the XLA path, not a GPU kernel that cannot lower
  there."""
  import jax

  chosen = jax.config.jax_default_device
  if isinstance(chosen, str):
    return jax.devices(chosen)[0]
  return chosen if chosen is not None else jax.devices()[0]


class KernelUnsupported(ValueError):
  """A kernel cannot serve these arguments (shape, dtype, mask, device)."""


def check_common(kernel: str, q_shape, k_shape, dtype, mask) -> tuple[int, int, int, int, int, int]:
  """The checks every kernel makes; returns (B, Tq, Tk, Nq, Nkv, D).

  `kernel` names the kernel in messages ("sm90 forward", ...). Kernel-specific
  limits (head dims, grid sizes) stay in each kernel's `check_supported`.
  """
  import jax.numpy as jnp

  from fa4_jax.scores import MaskSpec

  if len(q_shape) != 4 or len(k_shape) != 4:
    raise KernelUnsupported(
        f"{kernel}: q and k must be [batch, seq, heads, head_dim]; got q {q_shape}, k {k_shape}")
  b, tq, nq, d = q_shape
  bk, tk, nkv, dk = k_shape
  if b != bk:
    raise KernelUnsupported(f"{kernel}: q and k batch sizes differ: {b} vs {bk}")
  if d != dk:
    raise KernelUnsupported(f"{kernel}: q and k head dims differ: {d} vs {dk}")
  if nkv == 0 or nq % nkv:
    raise KernelUnsupported(
        f"{kernel}: number of query heads ({nq}) must be a multiple of key/value heads ({nkv})")
  if tq == 0 or tk == 0:
    raise KernelUnsupported(f"{kernel}: empty sequences are not supported")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise KernelUnsupported(f"{kernel}: dtype must be bfloat16 or float16; got {jnp.dtype(dtype)}")
  if not isinstance(mask, MaskSpec):
    raise KernelUnsupported(f"{kernel}: mask must be a MaskSpec; got {type(mask).__name__}")
  return b, tq, tk, nq, nkv, d
