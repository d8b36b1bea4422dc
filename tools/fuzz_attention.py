"""Random calls of `fa4_jax.attention` against the f32 einsum reference.

The tests check chosen cases; this draws calls the tests did not think of:
batch 1-3, odd lengths (queries and keys differ), GQA, head dims the
kernels take, causal or windowed masks, per-row lengths, segment ids
(sorted documents or interleaved ids, so rows may see no key), sinks (also
large ones) and soft-cap, a `score_mod` (ALiBi slopes or a relative-position
table, captured arrays whose gradients are checked too), a `mask_mod`
(prefix-LM per batch row, chunked local, a window plus global tokens), a
value head dim of its own, bf16 / fp16 (f32 on the XLA path) or all three
operands in float8 e4m3 with per-head descales, each combined at random. Every call's output and gradients (q, k, v, sinks and the
score_mod's array) are compared with `tests/reference.py`'s einsum
attention under the explicit mask and bias: outputs on the rows that see a
key, gradients as relative errors. float8 calls (no gradient) are compared
with the einsum on the dequantized operands, within the kernel's P
rounding: 2^-4 max|v| + 2^-8 |out| (`tests/test_sm90_fp8.py`); their output
error is printed in units of that bound.

    python3 tools/fuzz_attention.py --implementation sm90 --interpret [--trials 40]
    python3 tools/fuzz_attention.py --implementation sm90 --max-seq 2048   # on a GPU

`--interpret` runs the kernels in Pallas' GPU interpreter with race
detection (CPU; set NPROC=32, see `fa4_jax.interpret`; keep `--max-seq`
small). Prints one line per call and, for each failure, the arguments that
reproduce it; exits 1 if any call failed. `--seconds` stops drawing new
calls after that long (one GPU command has 10 minutes). On a GPU each call
compiles new kernels for its shape (40-55 s per call on H200 hosts with
several fuzzers at once): run a few processes with different `--seed`s,
each given `XLA_PYTHON_CLIENT_MEM_FRACTION` so that together they fit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # fa4_jax
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # reference

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402
from fa4_jax import testing  # noqa: E402
from reference import einsum_attention, random_packing, relative_error, visible_mask  # noqa: E402

# 16-bit inputs against the f32 reference of the same rounded inputs: O and
# P leave the kernels rounded to 16 bits (bf16: 2^-8 relative), so outputs
# of magnitude up to ~4 differ by up to ~3e-2; the gradients' relative
# (Frobenius) errors sit near 5e-3 (tests/test_on_gpu.py). f32 (XLA path):
# float32 rounding only.
TOLERANCES = {"bfloat16": (6e-2, 2e-2), "float16": (2e-2, 1e-2), "float32": (1e-4, 1e-4),
              "float8_e4m3fn": (1.0, 0.0)}  # float8: the output error in units of its bound


def draw_call(rng: np.random.Generator, implementation: str, max_seq: int) -> dict:
  """One random call's arguments (numpy; see the module docstring)."""
  b, t, s = int(rng.integers(1, 4)), int(rng.integers(1, max_seq)), int(rng.integers(1, max_seq))
  kv_heads = int(rng.choice([1, 2]))
  head_dim = int(rng.choice([64, 128] if implementation == "sm100" else [64, 64, 128, 128, 96, 256]))
  causal = bool(rng.random() < 0.5)
  window = None
  if rng.random() < 0.3:
    window = (int(rng.integers(0, max_seq // 4 + 1)), 0 if causal else int(rng.integers(0, max_seq // 4 + 1)))
  lengths = rng.random() < 0.4
  segments = None
  if rng.random() < 0.6:
    if rng.random() < 0.6:  # documents one after the other
      segments = [np.stack([random_packing(rng, n, 8) for _ in range(b)]) for n in (t, s)]
    else:  # interleaved ids: rows whose id no key has see nothing
      count = int(rng.integers(1, 5))
      segments = [rng.integers(0, count, size=(b, n)) for n in (t, s)]
  dtype = "float32" if implementation == "xla" else str(rng.choice(["bfloat16", "bfloat16", "float16"]))
  if implementation in ("xla", "sm90", "default") and rng.random() < 0.15:
    dtype = "float8_e4m3fn"
  return dict(
      batch=b, q_seq=t, kv_seq=s, q_heads=kv_heads * int(rng.choice([1, 2, 4])), kv_heads=kv_heads,
      head_dim=head_dim, dtype=dtype, is_causal=causal, window=window,
      q_lengths=rng.integers(1, t + 1, size=b) if lengths else None,
      kv_lengths=rng.integers(1, s + 1, size=b) if lengths else None,
      segment_ids=segments,
      # Large sinks only where the output's dtype has f32's range: a sink of
      # +15 leaves fp16 outputs of ~1e-6, fp16 subnormals, whose rounding
      # then dominates every gradient (delta is formed from the output).
      sinks=(rng.normal(size=1) * (30 if rng.random() < 0.25 and dtype != "float16" else 1)).item()
      if rng.random() < 0.4 else None,
      soft_cap=float(rng.choice([5.0, 30.0])) if rng.random() < 0.4 else None,
      score_mod=str(rng.choice(["alibi", "table"])) if rng.random() < 0.3 else None,
      mask_mod=str(rng.choice(["prefix", "chunked", "window_global"]))
      if rng.random() < 0.3 else None,
      # A value head dim of its own (the output's): the sm90 forward takes it.
      value_head_dim=int(rng.choice([64, 128])) if implementation in ("xla", "sm90", "default")
      and rng.random() < 0.2 else head_dim)


# --- the mods a call may draw: each a function for fa4_jax and the same thing
# as an explicit numpy bias / mask for the reference.

TABLE_BUCKETS = 16


def score_mod_of(kind: str):
  """(score_mod(captured) -> the mod, bias(captured, t, s) -> [1, N, T, S])."""
  if kind == "alibi":
    mod = lambda c: lambda x, b, h, i, j: x - c[h] * (i - j).astype(jnp.float32)
    bias = lambda c, t, s: (-c[:, None, None] * (np.arange(t)[:, None]
                                                  - np.arange(s)[None, :]))[None]
  else:  # a relative-position table [N, buckets], the distance clipped
    bucket = lambda i, j: jnp.clip(j - i + TABLE_BUCKETS // 2, 0, TABLE_BUCKETS - 1)
    mod = lambda c: lambda x, b, h, i, j: x + c[h, bucket(i, j)]
    bias = lambda c, t, s: c[:, bucket(jnp.arange(t)[:, None], jnp.arange(s)[None, :])][None]
  return mod, bias


def mask_mod_of(kind: str, prefix):
  """mask_mod(b, h, i, j) -> bool; `prefix` int32 [B] (per batch row)."""
  if kind == "prefix":
    return lambda b, h, i, j: (j < prefix[b]) | (j <= i)
  if kind == "chunked":
    return lambda b, h, i, j: (i // 32) == (j // 32)
  return lambda b, h, i, j: (jnp.abs(i - j) <= 24) | (j < 4) | (i < 4)


def check_call(call: dict, implementation: str | None, seed: int):
  """(output error, gradient error, all finite) of one call."""
  b, t, s, n, kh, d = (call[x] for x in ("batch", "q_seq", "kv_seq", "q_heads", "kv_heads", "head_dim"))
  dtype = jnp.dtype(call["dtype"])
  keys = jax.random.split(jax.random.key(seed), 4)
  dv = call.get("value_head_dim", d)
  q = (2 * jax.random.normal(keys[0], (b, t, n, d))).astype(dtype)
  k = jax.random.normal(keys[1], (b, s, kh, d)).astype(dtype)
  v = (1.0 + jax.random.normal(keys[2], (b, s, kh, dv))).astype(dtype)
  fp8 = dtype == jnp.dtype(jnp.float8_e4m3fn)
  if fp8:  # per-head scales: each head's largest magnitude at e4m3's 448
    q, k, v, descales = float8_operands(2 * jax.random.normal(keys[0], (b, t, n, d)),
                                        jax.random.normal(keys[1], (b, s, kh, d)),
                                        1.0 + jax.random.normal(keys[2], (b, s, kh, dv)))
  dout = jax.random.normal(keys[3], (b, t, n, dv), jnp.float32)
  as_int = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
  ids = call["segment_ids"] or (None, None)
  options = dict(is_causal=call["is_causal"], local_window_size=call["window"],
                 query_seq_lengths=as_int(call["q_lengths"]),
                 key_value_seq_lengths=as_int(call["kv_lengths"]),
                 query_segment_ids=as_int(ids[0]), key_value_segment_ids=as_int(ids[1]),
                 logits_soft_cap=call["soft_cap"])
  if fp8:
    options.update(query_descale=descales[0], key_descale=descales[1],
                   value_descale=descales[2])
  visible = visible_mask(t, s, is_causal=call["is_causal"], window=call["window"],
                         q_lengths=call["q_lengths"], kv_lengths=call["kv_lengths"], batch=b,
                         q_segment_ids=ids[0], kv_segment_ids=ids[1])
  if call.get("mask_mod"):
    prefix = jnp.asarray(np.random.default_rng(seed).integers(0, s + 1, size=b), jnp.int32)
    options["mask_mod"] = mask_mod_of(call["mask_mod"], prefix)
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    keep = np.asarray(jax.vmap(lambda bb: options["mask_mod"](bb, 0, i, j))(jnp.arange(b)))
    visible = visible & keep[:, None]
  # Rows past the query length hold anything; compare the others.
  valid_rows = np.ones((b, t), bool)
  if call["q_lengths"] is not None:
    valid_rows = np.arange(t)[None] < np.asarray(call["q_lengths"])[:, None]
  weights = jnp.asarray(valid_rows, jnp.float32)[:, :, None, None] * dout
  args = [q, k, v]
  # Optional arguments after q, k, v, by name: the score_mod's array, then
  # the sinks (last: `gradient_error` measures the sinks' gradient apart).
  extra = []
  score_mod = bias_of = None
  if call.get("score_mod"):
    score_mod, bias_of = score_mod_of(call["score_mod"])
    captured = (jnp.linspace(0.05, 0.5, n) if call["score_mod"] == "alibi" else
                jax.random.normal(jax.random.key(seed + 1), (n, TABLE_BUCKETS)))
    args.append(captured.astype(jnp.float32))
    extra.append("captured")
  if call["sinks"] is not None:
    args.append(jnp.full((n,), call["sinks"], jnp.float32) + jnp.arange(n, dtype=jnp.float32))
    extra.append("sinks")
  named = lambda a: dict(zip(extra, a[3:]))

  # The mask and the weights go in as arguments: closed over, they are
  # constants, and XLA's GPU compiler once spent over a second folding them.
  def ours(visible, *a):
    del visible
    more = named(a)
    mod = {} if score_mod is None else dict(score_mod=score_mod(more["captured"]))
    return fa4_jax.attention(*a[:3], sinks=more.get("sinks"), implementation=implementation,
                             **options, **mod)

  @jax.jit
  def reference_with_lse(visible, *a):
    more = named(a)
    bias = None if bias_of is None else bias_of(more["captured"], t, s)
    qkv = a[:3]
    if fp8:  # the dequantized operands
      qkv = [x.astype(jnp.float32) * scale[None, None, :, None]
             for x, scale in zip(qkv, descales)]
    return einsum_attention(*qkv, visible, bias=bias, sinks=more.get("sinks"),
                            soft_cap=call["soft_cap"])

  reference = lambda visible, *a: reference_with_lse(visible, *a)[0]

  loss = lambda f: lambda w, *a: jnp.sum(f(*a).astype(jnp.float32) * w)
  wrt = tuple(range(2, len(args) + 2))
  visible = jnp.asarray(visible)
  out, (want, want_lse) = jax.jit(ours)(visible, *args), reference_with_lse(visible, *args)
  if fp8:  # no gradient; the error in units of the P rounding's bound
    v_max = float(np.max(np.abs(np.asarray(v, np.float32) * np.asarray(descales[2])[:, None])))
    bound = 2.0 ** -4 * v_max + 2.0 ** -8 * np.abs(np.asarray(want))
    error = np.abs(np.asarray(out, np.float32) - np.asarray(want)) / bound
    finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
    return float(np.max(error[valid_rows], initial=0.0)), 0.0, finite
  grads = jax.jit(jax.grad(loss(ours), wrt))(weights, visible, *args)
  want_grads = jax.jit(jax.grad(loss(reference), wrt))(weights, visible, *args)
  out_error = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(want))[valid_rows],
                           initial=0.0))
  sink_terms = captured_terms = None
  if call["sinks"] is not None:
    sink_terms = sink_gradient_terms(want, want_lse, args[-1], weights)
  if score_mod is not None:
    captured_terms = captured_gradient_terms(
        lambda captured: reference_with_lse(visible, *args[:3], captured, *args[4:])[1],
        args[3], want, weights)
  grad_error = gradient_error(grads, want_grads, sink_terms, captured_terms)
  finite = all(bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in (out, *grads))
  return out_error, grad_error, finite


def float8_operands(q, k, v):
  """(q, k, v in e4m3, (q, k, v descales f32 per head)) of f32 arrays."""
  quantized, descales = [], []
  for x in (q, k, v):
    descale = jnp.maximum(jnp.abs(x).max(axis=(0, 1, 3)), 1e-6) / 448.0
    quantized.append((x / descale[None, None, :, None]).astype(jnp.float8_e4m3fn))
    descales.append(descale.astype(jnp.float32))
  return (*quantized, descales)


def sink_gradient_terms(out, lse, sinks, weights):
  """[N]: per head, the L2 norm of the terms that d sinks sums. d sink_h is
  -sum over rows of p_sink * delta (delta: the row's sum of weights *
  output), terms of both signs. A 16-bit kernel forms delta from its
  rounded output, so each term carries an error of about one rounding, of
  random sign: the sum's error grows like the terms' L2 norm, which can
  exceed the sum where the terms cancel. (It stays near the sum's size
  where they do not, so a wrong gradient still shows.)"""
  # out [B, T, N, H] and lse [B, N, T]: the reference's.
  p_sink = jnp.exp(sinks[None, :, None] - lse)  # lse includes the sink: never -inf
  delta = jnp.sum(weights * out, axis=-1).transpose(0, 2, 1)  # [B, N, T]
  return jnp.sqrt(jnp.sum((p_sink * delta) ** 2, axis=(0, 2)))


def captured_gradient_terms(lse_of, captured, out, weights):
  """The L2 norm of the row terms that the delta part of a captured array's
  gradient sums: delta_i d lse_i / d captured (delta: the row's sum of
  weights * output), one forward-mode derivative per element of the array.
  As for the sinks (`sink_gradient_terms`), a 16-bit kernel forms delta
  from its rounded output, so this part carries an error of about one
  rounding of each term, of random sign, which where the terms cancel
  exceeds the gradient itself (bf16 inputs on our XLA path show the same:
  a relative error of 0.4 on a soft-capped ALiBi call with packed rows)."""
  delta = jnp.sum(weights * out, axis=-1).transpose(0, 2, 1)  # [B, N, T]

  def norm_along(e):
    lse_tangent = jax.jvp(lse_of, (captured,), (e.reshape(captured.shape),))[1]
    return jnp.sum(jnp.where(jnp.isfinite(lse_tangent), delta * lse_tangent, 0.0) ** 2)

  basis = jnp.eye(captured.size, dtype=captured.dtype)
  return jnp.sqrt(jnp.sum(jax.lax.map(norm_along, basis)))


def gradient_error(grads, want_grads, sink_terms=None, captured_terms=None) -> float:
  """The largest error among the gradients: each relative to its exact
  value, or, where that nearly vanishes, against the call's largest
  gradient scaled to its size. Rows that see exactly one key have dq = dk =
  0 exactly, and a 16-bit kernel leaves rounding noise there (delta comes
  from the rounded output), small beside dv but infinite relative to 0.
  The sinks' gradient (last, where given) is measured against `sink_terms`
  (the L2 norm of the terms it sums) where that is larger, and a score_mod's
  array's (fourth, where given) against `captured_terms` likewise."""
  def against_terms(got, want, terms):
    scale = max(float(np.linalg.norm(np.asarray(want, np.float64))),
                float(np.linalg.norm(np.asarray(terms, np.float64))), 1e-6)
    return float(np.linalg.norm(np.asarray(got, np.float64)
                                - np.asarray(want, np.float64))) / scale

  if sink_terms is not None:
    *grads, got_sinks = grads
    *want_grads, want_sinks = want_grads
    return max(against_terms(got_sinks, want_sinks, sink_terms),
               gradient_error(grads, want_grads, captured_terms=captured_terms))
  if captured_terms is not None:
    captured_error = against_terms(grads[3], want_grads[3], captured_terms)
    return max(captured_error, gradient_error(grads[:3], want_grads[:3]))
  wants = [np.asarray(w, np.float64) for w in want_grads]
  norms = [float(np.linalg.norm(w)) for w in wants]
  largest = int(np.argmax(norms))
  errors = []
  for got, want, norm in zip(grads, wants, norms):
    got = np.asarray(got, np.float64)
    scale = norms[largest] * np.sqrt(want.size / wants[largest].size)
    if norm >= 1e-2 * scale:
      errors.append(relative_error(got, want))
    else:
      errors.append(float(np.linalg.norm(got - want)) / max(scale, 1e-6))
  return max(errors)


def describe(call: dict) -> str:
  short = {k: v for k, v in call.items() if k not in ("segment_ids", "q_lengths", "kv_lengths")}
  short["lengths"] = None if call["q_lengths"] is None else (
      list(map(int, call["q_lengths"])), list(map(int, call["kv_lengths"])))
  short["segment_ids"] = call["segment_ids"] is not None
  return " ".join(f"{k}={v}" for k, v in short.items())


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--implementation", default="sm90",
                  help="xla, sm90, sm100, or default (fa4_jax's choice)")
  ap.add_argument("--interpret", action="store_true",
                  help="kernels in the GPU interpreter with race detection (CPU)")
  ap.add_argument("--trials", type=int, default=40)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--max-seq", type=int, default=None,
                  help="longest query or key sequence drawn (default: 200 interpreted, else 1500)")
  ap.add_argument("--seconds", type=float, default=float("inf"))
  ap.add_argument("--only", type=int, default=None, help="check only this trial (a failure's)")
  args = ap.parse_args()
  implementation = None if args.implementation == "default" else args.implementation
  max_seq = args.max_seq or (200 if args.interpret else 1500)
  rng = np.random.default_rng(args.seed)
  start, failures, done = time.time(), 0, 0
  run = testing.run_interpreted if args.interpret else lambda fn, *a: fn(*a)
  for trial in range(args.trials):
    if time.time() - start > args.seconds:
      break
    call = draw_call(rng, args.implementation, max_seq)
    if args.only is not None and trial != args.only:
      continue
    raced = False
    try:
      errors = run(check_call, call, implementation, trial)
    except ValueError as e:  # a combination the implementation refuses, by name
      print(f"{trial} refused: {e}", flush=True)
      continue
    except AssertionError as e:  # run_interpreted: the race detector found one
      if "data race" not in str(e):
        raise
      errors, raced = (float("nan"), float("nan"), True), True
    out_error, grad_error, finite = errors
    out_tolerance, grad_tolerance = TOLERANCES[call["dtype"]]
    failed = out_error > out_tolerance or grad_error > grad_tolerance or not finite or raced
    failures += failed
    done += 1
    print(f"{trial} {'FAIL' if failed else 'ok'} out {out_error:.1e} grad {grad_error:.1e}"
          f"{' non-finite' if not finite else ''}{' RACE' if raced else ''} | {describe(call)}",
          flush=True)
    if failed:
      print(f"  reproduce: --implementation {args.implementation} --seed {args.seed} "
            f"--trials {trial + 1} --only {trial} --max-seq {max_seq}"
            f"{' --interpret' if args.interpret else ''}", flush=True)
  print(f"{done} calls, {failures} failed, {time.time() - start:.0f} s", flush=True)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
