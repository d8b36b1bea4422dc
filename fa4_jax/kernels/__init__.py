"""Pallas Mosaic GPU kernels.

Every kernel module offers the same two functions, which `fa4_jax.backends`
plugs into the shared `jax.custom_vjp` (see `fa4_jax/vjp.py`):

    check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None
        Raises `KernelUnsupported` (a ValueError) with a message naming the
        argument and what the kernel expects when it cannot serve the call.

    forward(q, k, v, q_lengths, kv_lengths, *, scale, mask) -> (out, lse)
        q: [B, Tq, Nq, D]; k, v: [B, Tk, Nkv, D]; Nq % Nkv == 0.
        q_lengths, kv_lengths: int32[B] or None.
        out: [B, Tq, Nq, D] in q.dtype; rows at or past q_lengths are zeros,
             and so are rows that see no key.
        lse: float32 [B, Nq, Tq], natural-log log-sum-exp of the scaled,
             masked logits; -inf where a row sees no key.

A backward module offers `backward(q, k, v, out, lse, dout, q_lengths,
kv_lengths, *, scale, mask) -> (dq, dk, dv)` with the same conventions.
"""


class KernelUnsupported(ValueError):
  """A kernel cannot serve these arguments (shape, dtype, mask, device)."""
