"""Partitioning of attention under `jax.jit` with sharded inputs.

`vjp.py` calls the backends only through `forward` and `backward` here, so
this module is the one place that decides how a call is split across devices.
For now both run the backend on whole (replicated or auto-partitioned)
arrays; sharding rules come with the multi-device work.
"""

from __future__ import annotations


def forward(config, q, k, v, bias, mask, q_lengths, kv_lengths):
  return config.backend.forward(q, k, v, bias, mask, q_lengths, kv_lengths,
                                scale=config.scale, spec=config.spec)


def backward(config, q, k, v, bias, mask, q_lengths, kv_lengths, out, lse, dout):
  return config.backend.backward(q, k, v, bias, mask, q_lengths, kv_lengths,
                                 out, lse, dout, scale=config.scale, spec=config.spec)
