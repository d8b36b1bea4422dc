"""The XLA path against jax.nn.dot_product_attention(implementation="xla").

    python benchmarks/bench_xla_path.py            # CPU: S = 4096; GPU: S = 16384
    python benchmarks/bench_xla_path.py --seq 8192

For each of forward and forward+backward, causal and not: XLA's compiled
memory analysis (temporary bytes: what the program needs beyond its inputs and
outputs) and the median wall-clock time of the jitted call over repeats after
a warm-up (block_until_ready around each call). On a GPU the peak bytes the
allocator saw are recorded too. A jax.nn run that fails (out of memory) is
recorded as such. Writes JSON to benchmarks/results/.
"""

import argparse
import datetime
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import bench_common  # this folder is on sys.path when run as a script
import fa4_jax

RESULTS = pathlib.Path(__file__).parent / "results"


def implementations():
  return {
      "fa4_jax_xla": lambda causal: lambda q, k, v: fa4_jax.attention(
          q, k, v, is_causal=causal, implementation="xla"),
      "jax_nn_xla": lambda causal: lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla"),
  }


def forward_and_backward(fn):
  loss = lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum()
  return jax.grad(loss, (0, 1, 2))


def measure(fn, args, repeats):
  jitted = jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  analysis = compiled.memory_analysis()
  temp = None if analysis is None else int(analysis.temp_size_in_bytes)
  median_ms = bench_common.wall_ms(compiled, args, repeats)
  stats = jax.devices()[0].memory_stats() or {}
  return {"temp_bytes": temp, "median_ms": median_ms,
          "repeats": repeats, "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def main():
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=16384 if on_gpu else 4096)
  parser.add_argument("--heads", type=int, default=16 if on_gpu else 4)
  parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
  parser.add_argument("--repeats", type=int, default=10 if on_gpu else 3)
  a = parser.parse_args()
  shape = (a.batch, a.seq, a.heads, a.head_dim)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(3))

  rows = []
  for causal in (False, True):
    for pass_name in ("forward", "forward+backward"):
      for name, make in implementations().items():
        fn = make(causal)
        if pass_name != "forward":
          fn = forward_and_backward(fn)
        try:
          result = measure(fn, (q, k, v), a.repeats)
        except Exception as e:  # e.g. RESOURCE_EXHAUSTED for jax.nn at long S
          result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        row = {"impl": name, "causal": causal, "pass": pass_name, **result}
        rows.append(row)
        print(json.dumps(row), flush=True)

  stamp = datetime.date.today().isoformat()
  kind = device.device_kind.replace(" ", "_")
  out = RESULTS / f"xla_path-{kind}-S{a.seq}-{stamp}.json"
  RESULTS.mkdir(exist_ok=True)
  out.write_text(json.dumps({
      "device": device.device_kind, "platform": device.platform,
      "jax": jax.__version__, "date": stamp, "dtype": "bfloat16",
      "shape_BSNH": shape, "method": "XLA compiled memory analysis; median wall clock "
      "of the jitted call after one warm-up", "rows": rows}, indent=1))
  print(f"\n{device.device_kind}, B{a.batch} S{a.seq} H{a.heads} D{a.head_dim} bf16")
  print(f"{'impl':14s} {'causal':6s} {'pass':17s} {'temp MiB':>9s} {'ms':>9s}")
  for r in rows:
    temp = "-" if r.get("temp_bytes") is None else f"{r['temp_bytes'] / 2**20:9.1f}"
    ms = f"{r['median_ms']:9.1f}" if "median_ms" in r else r["error"][:40]
    print(f"{r['impl']:14s} {str(r['causal']):6s} {r['pass']:17s} {temp:>9s} {ms:>9s}")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
