"""Does jax's cuDNN attention backward honour --xla_gpu_deterministic_ops?

Runs jax.grad of jax.nn.dot_product_attention(implementation="cudnn") six
times on the same inputs (B2 S8192 H16 D128 bf16, dense and causal) and
says whether dQ, dK, dV are bitwise equal across runs; prints XLA_FLAGS and
the cuDNN custom calls' backend_config lines of the compiled module; the
same for fa4_jax's default backward as a control.

Usage (GPU machine, repository root; run it twice):
    python3 benchmarks/cudnn_determinism.py
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python3 benchmarks/cudnn_determinism.py
Writes cudnn-determinism-<flags>-<device>-<date>.json to $OUT, or to
benchmarks/results/.
"""
import datetime, json, os, re, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
import fa4_jax

print("XLA_FLAGS =", os.environ.get("XLA_FLAGS"))
print(jax.devices()[0].device_kind)
out = {"xla_flags": os.environ.get("XLA_FLAGS"), "device": jax.devices()[0].device_kind, "rows": []}
B, S, H, D = 2, 8192, 16, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, g = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
for causal in (False, True):
  for name, fn in (("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")),
                   ("fa4_jax", lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal))):
    def loss(q, k, v):
      return jnp.sum(fn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
    gf = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if name == "cudnn":
      txt = gf.lower(q, k, v).compile().as_text()
      calls = [l.strip()[:400] for l in txt.splitlines() if "cudnn" in l and "custom-call" in l]
      for c in calls:
        print("  HLO:", c)
      det = sorted(set(re.findall(r'"?[a-z_]*determin[a-z_]*"?\s*[:=]\s*[^,}]+', txt)))
      print("  determinism fields in HLO:", det)
    first = [np.asarray(x) for x in gf(q, k, v)]
    same = [True, True, True]
    maxdiff = [0.0, 0.0, 0.0]
    for _ in range(5):
      again = [np.asarray(x) for x in gf(q, k, v)]
      for i in range(3):
        if not np.array_equal(first[i].view(np.uint16), again[i].view(np.uint16)):
          same[i] = False
          maxdiff[i] = max(maxdiff[i], float(np.max(np.abs(first[i].astype(np.float32) - again[i].astype(np.float32)))))
    row = dict(impl=name, causal=causal, bitwise_equal_dq_dk_dv=same, max_abs_diff=maxdiff)
    print(json.dumps(row), flush=True)
    out["rows"].append(row)
tag = "deterministic-flag" if "deterministic_ops=true" in (os.environ.get("XLA_FLAGS") or "") else "default-flags"
kind = jax.devices()[0].device_kind.replace(" ", "_")
folder = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
name = f"cudnn-determinism-{tag}-{kind}-{datetime.date.today().isoformat()}.json"
with open(os.path.join(folder, name), "w") as f:
  json.dump(out, f, indent=1)
