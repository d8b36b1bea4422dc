"""Generate text with a KV cache from the tiny character LM, with fa4_jax and
with jax.nn attention, and compare their speed and their tokens.

Trains its own copy of examples/train_tiny_lm.py's model briefly (that
script saves no weights to load), then decodes with
Flax's cache (`nnx.MultiHeadAttention` with `decode=True`): one token per
step, each layer's new key/value written into a cache of `--seq-len` slots,
and the query attending to the slots written so far (Flax passes that as a
`[batch, 1, 1, cache_length]` mask). The same trained weights decode twice:
with `attention_fn=fa4_jax.flax.attention_fn` and with Flax's default
(`nnx.dot_product_attention`, which calls `jax.nn.dot_product_attention`).
Decoding is greedy, so the two should pick the same tokens.

    python examples/generate.py                  # 300 training steps, 100 tokens
    python examples/generate.py --smoke          # a few steps and tokens, for tests
    python examples/generate.py --batch-size 64 --tokens 100 --prompt "The sea"
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fa4_jax.flax
import train_tiny_lm
from train_tiny_lm import CORPUS, CharTokenizer, TinyLM


def parse_args(argv=None):
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="a quick check: 10 training steps, 8 new tokens")
  p.add_argument("--steps", type=int, default=300, help="training steps")
  p.add_argument("--tokens", type=int, default=100, help="new tokens per sequence")
  p.add_argument("--batch-size", type=int, default=8,
                 help="sequences decoded at once (each step makes this many tokens)")
  p.add_argument("--seq-len", type=int, default=128,
                 help="training length = position table = KV cache length; "
                      "the prompt plus the new tokens must fit")
  p.add_argument("--prompt", default="The lighthouse")
  p.add_argument("--dtype", choices=["float32", "bfloat16"],
                 default="bfloat16" if on_gpu else "float32",
                 help="computation dtype, as in train_tiny_lm.py")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.tokens = 10, 8
  # The last new token is never fed back, so it needs no cache slot.
  if len(args.prompt) + args.tokens - 1 > args.seq_len:
    p.error(f"--prompt ({len(args.prompt)} characters) plus --tokens ({args.tokens}) "
            f"exceed --seq-len + 1 ({args.seq_len + 1})")
  if not args.prompt or args.tokens < 2:
    p.error("need a non-empty --prompt and --tokens >= 2")
  return args


def train_briefly(args, tokenizer: CharTokenizer, tokens: np.ndarray) -> TinyLM:
  """train_tiny_lm.py's model and training loop, with our length and dtype."""
  train_args = train_tiny_lm.parse_args([
      "--steps", str(args.steps), "--seq-len", str(args.seq_len),
      "--dtype", args.dtype, "--seed", str(args.seed), "--plot", "",
      "--log-every", str(max(1, args.steps // 5)),
      "--batch-size", "8" if args.smoke else "32"])
  model, _ = train_tiny_lm.train(train_args, tokenizer, tokens)
  return model


def decoding_copy(model: TinyLM, attention_fn, batch_size: int, cache_length: int,
                  dtype) -> TinyLM:
  """A copy of `model` whose attention layers decode with `attention_fn`,
  each with an empty cache of `cache_length` slots."""
  copy = nnx.clone(model)
  for block in copy.blocks:
    block.attn.attention_fn = attention_fn
    block.attn.decode = True
    block.attn.init_cache((batch_size, cache_length, block.attn.in_features), dtype)
  return copy


@nnx.jit
def decode_step(model: TinyLM, token, position):
  """Feeds `token` ([batch] ids) at `position` (a scalar), writing its keys
  and values into the caches. Returns the next token's logits and the
  greedy choice. Traced once: the token and position are arguments."""
  logits = model(token[:, None], position[None])[:, 0]
  return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def generate(model: TinyLM, prompt: np.ndarray, new_tokens: int):
  """Greedy decoding: feeds the prompt ([batch, P]) one token at a time,
  then each new token. Returns the new tokens [batch, new_tokens], the logits
  of every step [batch, P + new_tokens - 1, vocab], and the seconds the steps
  after the prompt took (the first prompt step compiles: it is not timed)."""
  # cached_partial walks the model's graph once, not on every step.
  step = nnx.cached_partial(decode_step, model)
  steps = []
  for position in range(prompt.shape[1]):
    steps.append(step(jnp.asarray(prompt[:, position]), jnp.int32(position)))
  jax.block_until_ready(steps[-1])
  start = time.perf_counter()
  for position in range(prompt.shape[1], prompt.shape[1] + new_tokens - 1):
    steps.append(step(steps[-1][1], jnp.int32(position)))
  jax.block_until_ready(steps[-1])
  seconds = time.perf_counter() - start
  chosen = [token for _, token in steps[prompt.shape[1] - 1:]]
  return (np.stack(chosen, axis=1), np.stack([logits for logits, _ in steps], axis=1),
          seconds)


def compare(name_a, a, name_b, b) -> str:
  """Whether two greedy decodings chose the same tokens, and their largest
  logit difference (up to the first disagreement, where inputs diverge)."""
  tokens_a, logits_a, _ = a
  tokens_b, logits_b, _ = b
  prompt_steps = logits_a.shape[1] - tokens_a.shape[1] + 1
  differ = np.argwhere(tokens_a != tokens_b)
  if differ.size == 0:
    gap = np.abs(logits_a - logits_b).max()
    return f"greedy tokens agree ({name_a} vs {name_b}): yes, max |logit difference| {gap:.2e}"
  row, first = differ[np.argmin(differ[:, 1])]
  gap = np.abs(logits_a[:, :prompt_steps + first] - logits_b[:, :prompt_steps + first]).max()
  return (f"greedy tokens agree ({name_a} vs {name_b}): no, first difference at new "
          f"token {first} (sequence {row}); max |logit difference| up to there {gap:.2e}")


def main(argv=None) -> dict:
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  text = CORPUS.read_text(encoding="utf-8")
  tokenizer = CharTokenizer(text)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"dtype {args.dtype}")
  model = train_briefly(args, tokenizer, tokenizer.encode(text))

  batch, cache_length = args.batch_size, args.seq_len
  heads = model.blocks[0].attn.num_heads
  head_dim = model.blocks[0].attn.head_dim
  query = jnp.zeros((batch, 1, heads, head_dim), dtype)
  cache = jnp.zeros((batch, cache_length, heads, head_dim), dtype)
  prefix = jnp.broadcast_to(jnp.arange(cache_length) <= len(args.prompt),
                            (batch, 1, 1, cache_length))
  implementation = fa4_jax.flax.which_implementation(query, cache, cache, mask=prefix)
  print(f"decode step (query {query.shape}, cache {cache.shape}, mask {prefix.shape}) "
        f"served by fa4_jax implementation: {implementation!r}")

  prompt = np.tile(tokenizer.encode(args.prompt), (batch, 1))
  results = {}
  for name, attention_fn in [("fa4_jax", fa4_jax.flax.attention_fn),
                             ("jax.nn", nnx.dot_product_attention)]:
    decoder = decoding_copy(model, attention_fn, batch, cache_length, dtype)
    results[name] = generate(decoder, prompt, args.tokens)
    generated = batch * (args.tokens - 1)
    seconds = results[name][2]
    print(f"{name}: {generated} tokens in {seconds:.3f} s, {generated / seconds:,.0f} "
          f"tokens/s ({args.tokens - 1} steps of batch {batch} after the prompt)")

  # The cache is right if decoding one token at a time gives the logits of
  # the uncached model (train_tiny_lm.py's causal forward) on the whole text.
  tokens, logits, _ = results["fa4_jax"]
  fed = np.concatenate([prompt, tokens[:, :-1]], axis=1)
  gap = np.abs(np.asarray(model(jnp.asarray(fed))) - logits).max()
  print(f"KV cache check: max |logit difference| from the uncached model {gap:.2e}")
  print(compare("fa4_jax", results["fa4_jax"], "jax.nn", results["jax.nn"]))
  print("text (sequence 0, fa4_jax):")
  print(args.prompt + tokenizer.decode(tokens[0]))
  return results


if __name__ == "__main__":
  main()
