"""What a score_mod costs, op by op: forward time of score_mod variants that isolate the cost of
a per-element table lookup (one load per element on sm90), the log bucket, and ALiBi's
int->float conversion. B2 S4096 H16 D128 bf16 dense unless named causal. The row "cudnn
dense bias32" is cuDNN (jax.nn.dot_product_attention) given table32's bias as a dense
[1, H, S, S] bf16 array, an argument of the call (MOD_COSTS_CUDNN=0 leaves it out).
MOD_COSTS_TABLE_LOADS=0: tables by the chain of selects (the default of
`sm90_tiles.PER_ELEMENT_TABLE_LOADS`), else by one load per element.
MOD_COSTS_ONLY="a|b": only the rows whose names contain one of these (and "plain").
The row "prefix-lm mask" is a mask_mod, not a score_mod.
MOD_COSTS_FOLD_DELTA=0: score_mod calls' dK/dV kernel as before #52's fold of delta
(`sm90_backward.FOLD_DELTA_WITH_SCORE_MOD`); MOD_COSTS_DQ3=1: score_mod calls without a
mask_mod on the plain call's three dQ consumers (`THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD`).
MOD_COSTS_FOLD_MASK=0: a mask_mod alone loads lse2 and delta before the wait instead of
folding them (`FOLD_STATS_WITH_MASK_MOD_ALONE`).
MOD_COSTS_HEAVY_FIRST=1: the backward kernels' CTAs take their tiles longest block list
first (`sm90_backward.HEAVY_TILES_FIRST_WITH_MODS`); =both: every mask_mod row twice in
one process, the second named "<row> heavy-first" with the switch on, the third
"<row> heavy-first dq3" with `THREE_DQ_CONSUMERS_WITH_MASK_MOD` on as well.
MOD_COSTS_FOLD_AFFINE=0: an affine score_mod's backward kernels form t = s * scale + C per
score as before instead of starting S^T / S at the form's terms and lse2
(`sm90_backward.FOLD_AFFINE_SCORE_MOD`); =delta: only the dQ kernel's dP starts at -delta
(`FOLD_AFFINE_SCORES` off); =both: every score_mod row twice in one process, the second
named "<row> no-affine-fold" with the switch off; =all: also "<row> delta-only".
MOD_COSTS_PERSISTENT=both: every score_mod row twice in one process, the second
named "<row> persistent" with `sm90_forward.MODS_ON_THE_PERSISTENT_GRID` on (a
score_mod alone keeps the heuristic's persistent grid and work queue).
MOD_COSTS_SEQ: the sequence length (default 4096).
Kernel-duration sum in a profiler trace (bench_common.kernel_sum_ms), median
of 10 calls, 2 interleaved rounds. With --ptxas: compiles each variant under
ptxas dumps (tests/ptxas_dumps) and prints registers and spills.

    python3 benchmarks/bench_mod_costs.py [--ptxas] [--backward]
--backward times jax.grad of the outputs' sum (the forward and the backward
kernels: the kernel-duration sum of the gradient call) instead of the forward
(no cuDNN row; errors: of the gradients against the XLA path), and per row each
Mosaic GPU kernel's median duration (`bench_common.kernel_medians`: forward,
dK/dV, dQ), so that a mod's backward cost shows which kernel carries it.
MOD_COSTS_TREE=DIR imports fa4_jax from DIR (a snapshot of an older commit,
to compare in one lease); MOD_COSTS_TAG names the output file
($OUT or . / mod-costs<TAG>.json)."""
import os, sys, json
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks")); sys.path.insert(0, os.path.join(REPO, "tests"))
# MOD_COSTS_TREE: where fa4_jax is imported from (a snapshot of an older commit).
sys.path.insert(0, os.environ.get("MOD_COSTS_TREE", REPO))

ITEMS = r'''
import os, sys
if os.environ.get("MOD_COSTS_TREE"): sys.path.insert(0, os.environ["MOD_COSTS_TREE"])
import numpy as np
import jax, jax.numpy as jnp
import fa4_jax
from fa4_jax.kernels import sm90_tiles
# Tables read by one load per element (held back by default until measured).
sm90_tiles.PER_ELEMENT_TABLE_LOADS = os.environ.get("MOD_COSTS_TABLE_LOADS", "1") == "1"
from fa4_jax.kernels import sm90_backward, sm90_forward
# MOD_COSTS_FOLD_DELTA=0: the dK/dV kernel of a score_mod call loads lse and delta
# before its wait, as the plain call does, instead of folding delta into dP^T.
if hasattr(sm90_backward, "FOLD_DELTA_WITH_SCORE_MOD"):
  sm90_backward.FOLD_DELTA_WITH_SCORE_MOD = os.environ.get("MOD_COSTS_FOLD_DELTA", "1") == "1"
# MOD_COSTS_DQ3=1: calls without a mask_mod keep the plain call's three dQ consumers.
if hasattr(sm90_backward, "THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD"):
  sm90_backward.THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD = os.environ.get("MOD_COSTS_DQ3") == "1"
# MOD_COSTS_FOLD_MASK=0: a call with a mask_mod alone loads lse2 and delta
# before the wait instead of folding them (`FOLD_STATS_WITH_MASK_MOD_ALONE`).
if hasattr(sm90_backward, "FOLD_STATS_WITH_MASK_MOD_ALONE"):
  sm90_backward.FOLD_STATS_WITH_MASK_MOD_ALONE = os.environ.get("MOD_COSTS_FOLD_MASK", "1") == "1"
# MOD_COSTS_HEAVY_FIRST=1: the backward's CTAs take the longest block lists first; =both:
# each mask_mod row also as "<row> heavy-first" (the switch set while it is traced).
_HEAVY = os.environ.get("MOD_COSTS_HEAVY_FIRST", "0")
# MOD_COSTS_FOLD_AFFINE=0: an affine score_mod's backward forms t per score as before
# (`sm90_backward.FOLD_AFFINE_SCORE_MOD` off); =delta: dQ's dP from -delta alone
# (`FOLD_AFFINE_SCORES` off); =both: each score_mod row also as "<row> no-affine-fold"
# (the switch off while it is traced); =all: also "<row> delta-only".
_AFFINE = os.environ.get("MOD_COSTS_FOLD_AFFINE", "1")
import contextlib
@contextlib.contextmanager
def switches(name):
  """The module switches of row `name` while its call is traced (those the tree has)."""
  saved = {}
  def put(attr, value, module=sm90_backward):
    if hasattr(module, attr):
      saved[(module, attr)] = getattr(module, attr)
      setattr(module, attr, value)
  put("HEAVY_TILES_FIRST_WITH_MODS", _HEAVY == "1" or " heavy-first" in name)
  put("THREE_DQ_CONSUMERS_WITH_MASK_MOD", name.endswith(" dq3"))
  put("FOLD_AFFINE_SCORE_MOD", _AFFINE != "0" and " no-affine-fold" not in name)
  put("FOLD_AFFINE_SCORES", _AFFINE != "delta" and " delta-only" not in name)
  put("MODS_ON_THE_PERSISTENT_GRID", name.endswith(" persistent"), module=sm90_forward)
  try:
    yield
  finally:
    for (module, attr), value in saved.items():
      setattr(module, attr, value)
B, S, H, D = 2, int(__import__("os").environ.get("MOD_COSTS_SEQ", 4096)), 16, 128
slopes = jnp.asarray([2.0 ** (-8 * (i + 1) / H) for i in range(H)])
table = jnp.asarray(np.random.default_rng(0).normal(size=(H, 32)) * 0.5, jnp.float32)
table8 = table[:, :8]
_rng = np.random.default_rng(1)
_sparse = {d: jnp.asarray(_rng.random(64) < d) for d in (0.25, 0.5)}  # as bench_mods.py draws them
_sparse50 = _sparse[0.5]
def bucket(q, k):
  rel = k - q
  sign_part = jnp.where(rel > 0, 16, 0)
  dist = jnp.abs(rel)
  big = 8 + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / 8) / np.log(16) * 8).astype(jnp.int32)
  return sign_part + jnp.where(dist < 8, dist, jnp.minimum(big, 15))
MODS = {
  "plain": (False, None),
  "plain causal": (True, None),
  "add const": (False, lambda s, b, h, q, k: s + 0.5),
  "alibi": (False, lambda s, b, h, q, k: s - slopes[h] * (q - k).astype(jnp.float32)),
  "alibi causal": (True, lambda s, b, h, q, k: s - slopes[h] * (q - k).astype(jnp.float32)),
  "int->float only": (False, lambda s, b, h, q, k: s + (k - q).astype(jnp.float32) * 1e-4),
  "table8 clip": (False, lambda s, b, h, q, k: s + table8[h, jnp.clip(k - q + 4, 0, 7)]),
  "table32 clip": (False, lambda s, b, h, q, k: s + table[h, jnp.clip(k - q + 16, 0, 31)]),
  "log bucket no table": (False, lambda s, b, h, q, k: s + bucket(q, k).astype(jnp.float32) * 0.01),
  "relative 32": (False, lambda s, b, h, q, k: s + table[h, bucket(q, k)]),
  # A mask_mod (third item): prefix-LM, 1024 keys every query sees, causal
  # after them (53 % of the pairs visible at S4096).
  "prefix-lm mask": (False, None, lambda b, h, q, k: (k < 1024) | (k <= q)),
  # bench_mods.py's block-sparse 50 %: an 8 x 8 pattern of 128-token tiles, repeated.
  "block-sparse50 mask": (False, None, lambda b, h, q, k: _sparse50[(q // 128) % 8 * 8 + (k // 128) % 8]),
}
if _HEAVY == "both":
  MODS.update({n + suffix: m for suffix in (" heavy-first", " heavy-first dq3")
               for n, m in list(MODS.items()) if len(m) > 2})
if os.environ.get("MOD_COSTS_PERSISTENT") == "both":
  MODS.update({n + " persistent": m for n, m in list(MODS.items())
               if m[1] is not None and (len(m) < 3 or m[2] is None)})
if _AFFINE in ("both", "all"):
  MODS.update({n + suffix: m for suffix in ((" no-affine-fold",) if _AFFINE == "both" else
                                            (" no-affine-fold", " delta-only"))
               for n, m in list(MODS.items()) if m[1] is not None})
keys = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(keys[0], (B, S, H, D), jnp.bfloat16)
k = jax.random.normal(keys[1], (B, S, H, D), jnp.bfloat16)
v = jax.random.normal(keys[2], (B, S, H, D), jnp.bfloat16)
def fwd(name, implementation="sm90"):
  causal, mod, *mask_mod = MODS[name]
  mask_mod = mask_mod[0] if mask_mod else None
  def call(q, k, v):
    with switches(name):
      return fa4_jax.attention(q, k, v, is_causal=causal, score_mod=mod, mask_mod=mask_mod,
                               implementation=implementation)
  return jax.jit(call)
_only = [w for w in os.environ.get("MOD_COSTS_ONLY", "").split("|") if w]
if _only:
  MODS = {n: m for n, m in MODS.items() if n == "plain" or any(w in n for w in _only)}
items = {name: (lambda name=name: fwd(name)(q, k, v)) for name in MODS}
def grad(name, implementation="sm90"):
  """jax.grad of the outputs' sum, to q, k and v."""
  attend = lambda q, k, v: fwd(name, implementation)(q, k, v).astype(jnp.float32).sum()
  gradient = jax.grad(attend, argnums=(0, 1, 2))
  def call(q, k, v):
    with switches(name):  # around the whole trace: the backward's too
      return gradient(q, k, v)
  return jax.jit(call)
def cudnn_bias():
  """(cuDNN's forward with table32's bias as a dense array, that bias)."""
  rel = jnp.clip(jnp.arange(S)[None, :] - jnp.arange(S)[:, None] + 16, 0, 31)
  bias = table[:, rel][None].astype(jnp.bfloat16)
  return jax.jit(lambda q, k, v, bias: jax.nn.dot_product_attention(
      q, k, v, bias=bias, implementation="cudnn")), bias
'''

def main():
  if "--ptxas" in sys.argv:
    import pathlib, re, tempfile, ptxas_dumps
    d = pathlib.Path(os.environ.get("OUT", tempfile.mkdtemp())) / ("ptxas-mods" + os.environ.get("MOD_COSTS_TAG", ""))
    d.mkdir(parents=True, exist_ok=True)
    calls = ptxas_dumps.compile_items(ITEMS, d, timeout=500)
    for name, dumps in calls:
      text = "\n".join(p.read_text() for p in dumps)
      regs = re.findall(r"Used (\d+) registers", text)
      print(f"{name:22s} spill bytes {ptxas_dumps.spill_bytes(dumps):6d} regs {regs} serialized {len(ptxas_dumps.serialized_wgmmas(dumps))}", flush=True)
    return
  import bench_common
  ns = {}
  exec(ITEMS, ns)
  backward = "--backward" in sys.argv
  timed_fn = ns["grad"] if backward else ns["fwd"]
  rows, errors = {}, {}
  # One jitted function a row, compiled once: checked here, timed below.
  fns = {name: timed_fn(name) for name in ns["MODS"]}
  wants = {}  # the XLA path's, once per variant (a switch changes our kernels only)
  for name in ns["MODS"]:  # max |kernel - XLA path| (bf16 values of unit scale)
    args = (ns["q"], ns["k"], ns["v"])
    base = name.split(" heavy-first")[0].split(" no-affine-fold")[0].split(" delta-only")[0]
    if base not in wants:
      wants[base] = timed_fn(base, "xla")(*args)
    got, want = fns[name](*args), wants[base]
    errors[name] = max(float(abs(g.astype("float32") - w.astype("float32")).max())
                       for g, w in zip(*map(ns["jax"].tree_util.tree_leaves, (got, want))))
  timed = {name: (fns[name], ()) for name in ns["MODS"]}
  if not backward and os.environ.get("MOD_COSTS_CUDNN", "1") != "0":
    try:
      cudnn, bias = ns["cudnn_bias"]()
      got = cudnn(ns["q"], ns["k"], ns["v"], bias)
      want = ns["fwd"]("table32 clip", "xla")(ns["q"], ns["k"], ns["v"])
      errors["cudnn dense bias32"] = float(abs(got.astype("float32") - want.astype("float32")).max())
      timed["cudnn dense bias32"] = (cudnn, (bias,))
    except Exception as e:  # noqa: BLE001  (no cuDNN attention here: the row is left out)
      print("cudnn dense bias32 left out:", type(e).__name__, str(e)[:300], flush=True)
  rows, kernels = {}, {}
  for rnd in range(2):
    for name, (f, extra) in timed.items():
      ms = bench_common.kernel_sum_ms(f, ns["q"], ns["k"], ns["v"], *extra)
      rows.setdefault(name, []).append(ms)
      print(rnd, name, f"{ms:.3f}", flush=True)
      if backward:  # which kernel carries the cost: each Mosaic GPU kernel's median
        _, per_kernel = bench_common.kernel_medians(f, (ns["q"], ns["k"], ns["v"], *extra))
        mosaic = {n: d for n, _, d in per_kernel if "mosaic" in n}
        kernels.setdefault(name, []).append(mosaic)
        print("   ", "  ".join(f"{n.split('_mosaic')[0]} {d:.3f}" for n, d in mosaic.items()))
  import statistics
  base = statistics.median(rows["plain"])
  out = {n: dict(ms=statistics.median(t), rounds=t, vs_plain=statistics.median(t) / base,
                 max_abs_error_vs_xla=errors[n]) for n, t in rows.items()}
  for n, per_round in kernels.items():
    out[n]["kernels_ms"] = per_round  # per round: {kernel: median duration}
  for n, r in out.items():
    print(f"{n:22s} {r['ms']:.3f} ms  x{r['vs_plain']:.2f}  err {errors[n]:.2e}")
  import jax
  tag = os.environ.get("MOD_COSTS_TAG", "") + ("-backward" if backward else "")
  with open(os.path.join(os.environ.get("OUT", "."), f"mod-costs{tag}.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, shape=f"B2 S{ns['S']} H16 D128 bf16",
                   timed="jax.grad of the outputs' sum" if backward else "forward",
                   method="sum of kernel durations in a profiler trace, median of 10 calls, "
                          "median of 2 interleaved rounds", rows=out), f, indent=1)

if __name__ == "__main__":
  main()
