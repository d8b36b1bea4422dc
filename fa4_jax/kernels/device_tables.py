"""Choices measured per GPU kind (`jax.Device.device_kind`), for the callers
that read them through one function each (`sm90_decode.device_choices`).

A kind missing here gets `GENERIC_DECODE`, the rules that were measured on
no kind in particular (every SM streams, the kernel's own consumers). Under
`fa4_jax.gpu_target` (export, AOT lowering from a host without the GPU)
callers ask for `None`, so lowering never queries a device and a module
exported once runs the generic rules on every Hopper.

Each entry says what it was measured with; the figures, what lost and the
result files are in docs/performance-notes.md: "Decode choices per device
kind" (H200) and, under "Decode: the arrangement, not a new kernel", the
paragraph "Fewer CTAs read faster" (H100).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeChoices:
  """Knobs of the decode arrangement (`sm90_decode.plan`) for one kind.

  streaming_ctas: CTAs that read a cache at once at head dims >= 128 and up
    to 64 packed rows, where fewer than the SMs win
    (`sm90_decode.streaming_ctas`; None: the SM count). The splits fill that
    many CTAs and more items than that, shared evenly, run on a persistent
    grid of that many CTAs.
  one_consumer_max_rows: at head dims <= 64, up to this many packed rows per
    item (0: never), with full, equal key lengths and items within one wave
    of the SMs, each item runs on one CTA with one consumer warpgroup (64
    rows, no ping-pong) and `one_consumer_stages` K/V ring slots, instead
    of the kernel's three consumers on a two-slot ring
    (`sm90_decode.one_consumer_config`).
  """

  streaming_ctas: int | None = None
  one_consumer_max_rows: int = 0
  one_consumer_stages: int = 4


GENERIC_DECODE = DecodeChoices()

DECODE = {
    # H100 SXM, one token, GQA 32/8 D128, TB/s of K/V read, 3 interleaved
    # rounds (notes: "Fewer CTAs read faster"): B32 S8k (256 items) on a persistent grid
    # of 64 CTAs 3.128, of 128 3.094, of 132 3.070, one CTA per item 3.039
    # (cuDNN 3.070); B64 S4k 3.085 / 3.069 / 3.054 / 3.043 (cuDNN 3.057); B8
    # S32k one CTA per item: 64 CTAs (1 chunk) 3.131, 128 (2 chunks) 3.067;
    # B8 T16 3.087 vs 3.006; B1 S131k 8 chunks 3.03 vs 16 chunks 2.99; D256
    # 3.13 vs 3.08. A grid whose CTAs share items unevenly loses (88 CTAs:
    # 2.84). More CTAs win at D64 (B8 S32k: 2 chunks 3.02, 1 chunk 2.36) and
    # with 128 rows (B8 T32: 2.98 vs 2.85).
    # * One consumer warpgroup, 4 K/V slots at D64 (2026-12-07, 2
    #   interleaved rounds, `bench_decode_tuning.py --mode sweep --only D64`;
    #   notes: "#54 on an H100, 2026-12-07 (session from 14:20 UTC)"): B64
    #   S1024 H8/2 3.441 vs 3.149 for three consumers (cuDNN 3.114); MQA B16
    #   S16k H8/1 2.517 vs 2.499 (cuDNN 2.271); B8 S32k H32/8 3.060-3.074 vs
    #   3.092 (cuDNN 3.044), the one row it does not win, by 1 %.
    "NVIDIA H100 80GB HBM3": DecodeChoices(streaming_ctas=64, one_consumer_max_rows=8),
    # H200 (141 GB HBM3e), bf16, T1, TB/s of K/V read once, sum of kernel
    # durations in a profiler trace, 3 interleaved rounds, cuDNN in the same
    # process (notes: "Decode choices per device kind"):
    # * 128 streams at D128, not 64 and not 132: B64 S4k (512 items) on a
    #   persistent grid of 128 CTAs 4.440, of 132 4.382, of 64 3.405, one CTA
    #   per item 4.310 (cuDNN 4.390); B32 S8k 4.465 / 4.385 / 3.435 / 4.341
    #   (cuDNN 4.413). The rows of 128 CTAs or fewer keep their plans (B8 S32k
    #   2 chunks 4.440, B1 S131k 16 chunks 4.250).
    # * One consumer warpgroup, 4 K/V slots at D64: MQA B16 S16k H8/1 (8
    #   rows, 8 chunks) 3.269 vs 3.192 for three consumers on 2 slots (cuDNN
    #   2.954, XLA 2.067); B64 S1024 H8/2 (4 rows, 1 chunk) 3.421 vs 3.158
    #   (cuDNN 3.187); B8 S32k H32/8 (4 rows, 2 chunks) 4.343 vs 4.300 (cuDNN
    #   4.281). More slots with three consumers lose (B64 S1024: 4 slots
    #   3.102, B8 S32k: 6 slots 4.238), as do more chunks (MQA 16 chunks
    #   2.93-2.99).
    "NVIDIA H200": DecodeChoices(streaming_ctas=128, one_consumer_max_rows=8),
}


def decode_choices(device_kind: str | None) -> DecodeChoices:
  """The decode choices of a device kind; `GENERIC_DECODE` for None (no
  device, or a `gpu_target`) and for kinds not in `DECODE`."""
  return DECODE.get(device_kind, GENERIC_DECODE) if device_kind else GENERIC_DECODE
