"""The XLA path's memory is linear in sequence length: no T x S buffer.

Checked on the compiled program (XLA's own memory analysis), forward and
backward, at a length where a T x S float32 buffer would dwarf everything else.
"""

import jax
import jax.numpy as jnp
import pytest

import fa4_jax

B, S, N, H = 1, 4096, 2, 64
TxS_BYTES = B * N * S * S * 4  # one f32 logits buffer: 128 MiB


def temp_bytes(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    pytest.skip("this backend reports no memory analysis")
  return analysis.temp_size_in_bytes


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_and_backward_never_hold_a_sequence_squared_buffer(is_causal):
  x = jax.ShapeDtypeStruct((B, S, N, H), jnp.bfloat16)
  loss = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=is_causal).astype(jnp.float32).sum()
  ours = temp_bytes(jax.grad(loss, (0, 1, 2)), x, x, x)
  assert ours < TxS_BYTES / 8, f"{ours / 2**20:.1f} MiB of temporaries"
  # The check has teeth: jax.nn's XLA implementation does hold one.
  nn_loss = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=is_causal, implementation="xla").astype(jnp.float32).sum()
  assert temp_bytes(jax.grad(nn_loss, (0, 1, 2)), x, x, x) >= TxS_BYTES / 2
