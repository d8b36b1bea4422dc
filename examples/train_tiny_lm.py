"""Train a tiny character-level language model whose attention is fa4_jax.

A decoder-only transformer in Flax NNX: each block's `nnx.MultiHeadAttention`
gets `attention_fn=fa4_jax.flax.attention_fn` and is called with
`is_causal=True`. On a CPU fa4_jax runs its XLA path; on a Hopper or
Blackwell GPU (with `--dtype bfloat16`, the default there) its Mosaic GPU
kernels. The script prints which one serves the attention.

    pip install -e ".[flax]"            # flax, optax, matplotlib
    python examples/train_tiny_lm.py              # 300 steps, ~1-2 min on a CPU
    python examples/train_tiny_lm.py --smoke      # 20 steps, for tests
    python examples/train_tiny_lm.py --steps 2000 --plot loss.png

The corpus is examples/data/tiny_corpus.txt (a short original story, shipped
with the repository); every character is one token.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fa4_jax
import fa4_jax.flax

CORPUS = pathlib.Path(__file__).parent / "data" / "tiny_corpus.txt"


# --- Data -----------------------------------------------------------------------


class CharTokenizer:
  """Characters <-> integer ids, built from the corpus."""

  def __init__(self, text: str):
    self.chars = sorted(set(text))
    self.ids = {c: i for i, c in enumerate(self.chars)}

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    return np.array([self.ids[c] for c in text], np.int32)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)


def random_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
  """Endless (inputs, targets) pairs: random windows, targets shifted by one."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    windows = np.stack([tokens[s:s + seq_len + 1] for s in starts])
    yield windows[:, :-1], windows[:, 1:]


# --- Model ----------------------------------------------------------------------


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention, then an MLP."""

  def __init__(self, d_model: int, num_heads: int, dtype, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=d_model, dtype=dtype, decode=False,
        attention_fn=fa4_jax.flax.attention_fn, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x), is_causal=True)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TinyLM(nnx.Module):
  """Token + learned position embeddings, `num_layers` blocks, a readout."""

  def __init__(self, vocab_size: int, seq_len: int, d_model: int, num_heads: int,
               num_layers: int, dtype, *, rngs: nnx.Rngs):
    self.token_embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
    self.pos_embed = nnx.Embed(seq_len, d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(d_model, num_heads, dtype, rngs=rngs)
                            for _ in range(num_layers)])
    self.final_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.readout = nnx.Linear(d_model, vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, positions=None):
    """[batch, seq] int32 -> [batch, seq, vocab] logits. `positions` ([seq])
    defaults to 0..seq-1; cached decoding passes the position of its token."""
    if positions is None:
      positions = jnp.arange(tokens.shape[1])
    x = self.token_embed(tokens) + self.pos_embed(positions)
    for block in self.blocks:
      x = block(x)
    return self.readout(self.final_norm(x)).astype(jnp.float32)


def loss_fn(model: TinyLM, inputs, targets):
  logits = model(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model: TinyLM, optimizer: nnx.Optimizer, inputs, targets):
  loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def next_token_logits(model: TinyLM, context, position):
  """Logits for the token after `context[:, position]` (causal: later slots
  of the fixed-size context do not matter)."""
  return model(context)[:, position]


def sample(model: TinyLM, tokenizer: CharTokenizer, prompt: str, length: int,
           seq_len: int, temperature: float = 0.8, seed: int = 0) -> str:
  """Generates `length` characters after `prompt`, one at a time."""
  ids = list(tokenizer.encode(prompt))
  key = jax.random.key(seed)
  for _ in range(length):
    window = ids[-seq_len:]
    context = np.zeros((1, seq_len), np.int32)
    context[0, :len(window)] = window
    logits = next_token_logits(model, jnp.asarray(context), len(window) - 1)
    key, subkey = jax.random.split(key)
    ids.append(int(jax.random.categorical(subkey, logits[0] / temperature)))
  return tokenizer.decode(ids)


# --- Reporting ------------------------------------------------------------------


def progress_line(step: int, steps: int, loss: float, tokens_per_s: float) -> str:
  width = 30
  done = int(width * step / steps)
  bar = "#" * done + "." * (width - done)
  return f"[{bar}] step {step:>5}/{steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s"


def save_loss_plot(losses, path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: skipping the loss plot "
          "(pip install matplotlib, or the [flax] extra)")
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(np.arange(1, len(losses) + 1), losses)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/char)")
  ax.set_title("tiny character LM with fa4_jax attention")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  print(f"loss curve saved to {path}")


# --- Main -----------------------------------------------------------------------


def parse_args(argv=None):
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=300, help="training steps")
  p.add_argument("--smoke", action="store_true",
                 help="a quick check: 20 steps, a smaller batch, no plot or sample")
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=2,
                 help="attention heads; head_dim = d_model / heads (the GPU "
                      "kernels take 64, 128 or 256 on Blackwell, multiples of 16 "
                      "up to 256 on Hopper)")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--dtype", choices=["float32", "bfloat16"],
                 default="bfloat16" if on_gpu else "float32",
                 help="computation dtype (the GPU kernels take bfloat16/float16; "
                      "parameters stay float32)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--plot", default="tiny_lm_loss.png",
                 help="where to save the loss curve ('' for none)")
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.batch_size, args.log_every, args.plot = 20, 16, 5, ""
  return args


def train(args, tokenizer: CharTokenizer, tokens: np.ndarray):
  """Builds the model `args` describe and trains it for `args.steps` steps on
  `tokens`, printing progress. Returns the model and a summary dict."""
  dtype = jnp.dtype(args.dtype)
  model = TinyLM(tokenizer.vocab_size, args.seq_len, args.d_model, args.heads,
                 args.layers, dtype, rngs=nnx.Rngs(args.seed))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=max(1, min(50, args.steps // 10)),
      decay_steps=args.steps, end_value=args.lr / 10)
  optimizer = nnx.Optimizer(
      model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)),
      wrt=nnx.Param)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"{n_params:,} parameters")

  # The query/key/value each attention layer hands to fa4_jax: [B, T, heads, head_dim].
  qkv = jnp.zeros((args.batch_size, args.seq_len, args.heads,
                   args.d_model // args.heads), dtype)
  implementation = fa4_jax.flax.which_implementation(qkv, qkv, qkv, is_causal=True)
  print(f"attention served by fa4_jax implementation: {implementation!r}")
  if jax.default_backend() == "gpu" and implementation == "xla":
    print("  (no kernel for these arguments: the kernels need --dtype bfloat16 "
          "and a head_dim they support, see --heads)")

  batches = random_batches(tokens, args.batch_size, args.seq_len, args.seed)
  tokens_per_step = args.batch_size * args.seq_len
  interactive = sys.stdout.isatty()
  losses = []
  start = time.perf_counter()
  timed_from = None  # the first step compiles: time from the second one on
  for step in range(1, args.steps + 1):
    inputs, targets = next(batches)
    loss = float(train_step(model, optimizer, inputs, targets))  # waits for the step
    losses.append(loss)
    if step == 1:
      timed_from = time.perf_counter()
      print(f"step 1 (includes compilation): {timed_from - start:.1f} s, loss {loss:.4f}")
    elif step % args.log_every == 0 or step == args.steps:
      rate = tokens_per_step * (step - 1) / (time.perf_counter() - timed_from)
      line = progress_line(step, args.steps, loss, rate)
      print("\r" + line if interactive else line, end="" if interactive else "\n",
            flush=True)
  if interactive:
    print()
  elapsed = time.perf_counter() - start
  timed_steps = args.steps - 1
  rate = tokens_per_step * timed_steps / (time.perf_counter() - timed_from) if timed_steps else 0.0

  # Average a few steps at each end: one batch's loss is noisy.
  k = max(1, min(10, len(losses) // 4))
  first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
  print(f"done: {args.steps} steps in {elapsed:.1f} s, {rate:,.0f} tokens/s after "
        f"compilation; loss {first:.4f} -> {last:.4f} (mean of first/last {k} steps)")
  return model, dict(first_loss=first, last_loss=last, tokens_per_s=rate,
                     implementation=implementation, losses=losses)


def main(argv=None) -> dict:
  args = parse_args(argv)
  text = CORPUS.read_text(encoding="utf-8")
  tokenizer = CharTokenizer(text)
  tokens = tokenizer.encode(text)
  print(f"corpus: {len(tokens):,} characters, vocabulary of {tokenizer.vocab_size}")
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"dtype {args.dtype}")

  model, summary = train(args, tokenizer, tokens)
  if args.plot:
    save_loss_plot(summary["losses"], args.plot)
  if not args.smoke:
    print("sample:")
    print(sample(model, tokenizer, "The lighthouse", 200, args.seq_len, seed=args.seed))
  return dict(first_loss=summary["first_loss"], last_loss=summary["last_loss"],
              tokens_per_s=summary["tokens_per_s"],
              implementation=summary["implementation"])


if __name__ == "__main__":
  main()
