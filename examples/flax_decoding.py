"""Greedy decoding with a KV cache: a small flax.nnx decoder whose attention is jax_flashattn.

    python examples/flax_decoding.py                      # 32 tokens for each of 2 prompts
    python examples/flax_decoding.py --steps 64 --batch 4 --max-len 512

The model: byte embedding plus learned positions, pre-LayerNorm blocks (grouped-query attention with
4 query heads sharing 2 K/V heads, then a GELU MLP), a byte classifier; random weights, float32.
Generation has two jitted functions:
  * `prefill`: one causal call over the prompts (padded at the end to a common length) whose K/V
    land at the start of a cache preallocated at [B, max_len, K, H] per layer;
  * `decode_step`: one token per sequence, its K/V written at that sequence's own length, its query
    attending to the cache's valid rows through `key_value_seq_lengths`. Both donate the cache, so
    XLA writes into the cache's buffers instead of copying them.
The script then checks that the logits each token was chosen from match the model run without a
cache over the whole sequence (prompt and generated tokens). Walkthrough: docs/decoding.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import jax_flashattn as jfa

PROMPTS = [b"The quick brown fox jumps over", b"Attention is", b"Once upon a time, in a land far away,",
           b"JAX"]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 256     # bytes
    width: int = 128
    layers: int = 2
    query_heads: int = 4
    kv_heads: int = 2
    max_len: int = 256        # positions the model knows, and the cache's length

    @property
    def head_dim(self) -> int:
        return self.width // self.query_heads


class KVCache(NamedTuple):
    keys: tuple[jax.Array, ...]     # per layer, [B, max_len, K, H]
    values: tuple[jax.Array, ...]   # per layer, [B, max_len, K, H]
    lengths: jax.Array              # int32 [B]: the tokens of each sequence the cache holds


def empty_cache(config: Config, batch: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, config.max_len, config.kv_heads, config.head_dim)
    per_layer = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.layers))  # noqa: E731
    return KVCache(per_layer(), per_layer(), jnp.zeros((batch,), jnp.int32))


def write_rows(buffer, rows, starts):
    """buffer [B, L, ...] with rows [B, R, ...] written at rows starts[b].. of each sequence b."""
    def write_one(buffer, rows, start):
        return jax.lax.dynamic_update_slice(buffer, rows, (start,) + (0,) * (buffer.ndim - 1))
    return jax.vmap(write_one)(buffer, rows, starts)


class Attention(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.query_heads, self.kv_heads, self.head_dim = config.query_heads, config.kv_heads, config.head_dim
        self.query = nnx.Linear(config.width, config.query_heads * config.head_dim, rngs=rngs)
        self.key = nnx.Linear(config.width, config.kv_heads * config.head_dim, rngs=rngs)
        self.value = nnx.Linear(config.width, config.kv_heads * config.head_dim, rngs=rngs)
        self.out = nnx.Linear(config.query_heads * config.head_dim, config.width, rngs=rngs)

    def _project(self, x):
        """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H]."""
        B, T, _ = x.shape
        return (self.query(x).reshape(B, T, self.query_heads, self.head_dim),
                self.key(x).reshape(B, T, self.kv_heads, self.head_dim),
                self.value(x).reshape(B, T, self.kv_heads, self.head_dim))

    def _combine(self, out):
        return self.out(out.reshape(out.shape[:2] + (-1,)))

    def __call__(self, x, lengths):
        """Causal self-attention over x [B, T, D], sequence b being its first lengths[b] rows; also
        returns the K/V, for the cache."""
        q, k, v = self._project(x)
        out = jfa.flash_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                  key_value_seq_lengths=lengths)
        return self._combine(out), k, v

    def decode(self, x, key_cache, value_cache, lengths):
        """One new token per sequence, x [B, 1, D] at position lengths[b]: writes its K/V into the
        cache [B, max_len, K, H] and attends to the cache's first lengths[b] + 1 rows."""
        q, k, v = self._project(x)
        key_cache = write_rows(key_cache, k, lengths)
        value_cache = write_rows(value_cache, v, lengths)
        # Bottom-right alignment puts the query at its sequence's last valid key (top-left: at key 0).
        out = jfa.flash_attention(q, key_cache, value_cache, is_causal=True, causal_alignment="bottom_right",
                                  key_value_seq_lengths=lengths + 1)
        return self._combine(out), key_cache, value_cache


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.attention = Attention(config, rngs)
        self.mlp_norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.mlp_in = nnx.Linear(config.width, 4 * config.width, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * config.width, config.width, rngs=rngs)

    def _mlp(self, x):
        return self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))

    def __call__(self, x, lengths):
        y, k, v = self.attention(self.attention_norm(x), lengths)
        x = x + y
        return x + self._mlp(x), k, v

    def decode(self, x, key_cache, value_cache, lengths):
        y, key_cache, value_cache = self.attention.decode(self.attention_norm(x), key_cache, value_cache, lengths)
        x = x + y
        return x + self._mlp(x), key_cache, value_cache


class Decoder(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.config = config
        self.token_embedding = nnx.Embed(config.vocab_size, config.width, rngs=rngs)
        self.position_embedding = nnx.Embed(config.max_len, config.width, rngs=rngs)
        blocks = [Block(config, rngs) for _ in range(config.layers)]
        # Flax 0.12 wants lists of modules wrapped in nnx.List, which older versions lack.
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
        self.norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, config.vocab_size, rngs=rngs)

    def __call__(self, tokens, lengths):
        """Logits [B, T, V] of tokens [B, T] (sequence b: its first lengths[b] tokens), without a
        cache, and each layer's (K, V)."""
        positions = jnp.arange(tokens.shape[1])[None]
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        layer_kv = []
        for block in self.blocks:
            x, k, v = block(x, lengths)
            layer_kv.append((k, v))
        return self.head(self.norm(x)), layer_kv

    def decode(self, tokens, cache: KVCache):
        """Logits [B, V] of one new token per sequence, tokens [B] at positions cache.lengths, and
        the cache with their K/V."""
        x = self.token_embedding(tokens[:, None]) + self.position_embedding(cache.lengths[:, None])
        keys, values = [], []
        for block, key_cache, value_cache in zip(self.blocks, cache.keys, cache.values):
            x, key_cache, value_cache = block.decode(x, key_cache, value_cache, cache.lengths)
            keys.append(key_cache)
            values.append(value_cache)
        logits = self.head(self.norm(x))[:, 0]
        return logits, KVCache(tuple(keys), tuple(values), cache.lengths + 1)


# The graph definition is static (hashable); the cache (argument 2) is donated, so its buffers are
# reused for the returned cache and the caller's old cache arrays are deleted.
@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(graphdef, params, cache: KVCache, prompts, prompt_lengths):
    """Runs the prompts [B, T] (sequence b: its first prompt_lengths[b] tokens), writes their K/V at
    the cache's start; returns the logits of each prompt's last token [B, V] and the cache."""
    logits, layer_kv = nnx.merge(graphdef, params)(prompts, prompt_lengths)
    origin = (0, 0, 0, 0)
    keys = tuple(jax.lax.dynamic_update_slice(c, k, origin) for c, (k, _) in zip(cache.keys, layer_kv))
    values = tuple(jax.lax.dynamic_update_slice(c, v, origin) for c, (_, v) in zip(cache.values, layer_kv))
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, KVCache(keys, values, prompt_lengths)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_step(graphdef, params, cache: KVCache, tokens):
    """Logits [B, V] of tokens [B], appended to the cache, and the updated cache."""
    return nnx.merge(graphdef, params).decode(tokens, cache)


def generate(model: Decoder, prompts, prompt_lengths, steps: int):
    """Greedy continuation of the prompts: the new tokens [B, steps] and the logits each was chosen
    from [B, steps, V] (the first from the prefill, the others from decode steps)."""
    batch, prompt_len = prompts.shape
    if prompt_len + steps > model.config.max_len:
        raise ValueError(f"{prompt_len} prompt tokens + {steps} steps exceed max_len {model.config.max_len}")
    graphdef, params = nnx.split(model)
    logits, cache = prefill(graphdef, params, empty_cache(model.config, batch), prompts, prompt_lengths)
    tokens, chosen_from = [], []
    for step in range(steps):
        if step > 0:
            logits, cache = decode_step(graphdef, params, cache, tokens[-1])
        tokens.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        chosen_from.append(logits)
    return jnp.stack(tokens, axis=1), jnp.stack(chosen_from, axis=1)


@nnx.jit
def full_sequence_logits(model: Decoder, prompts, prompt_lengths, generated):
    """The logits generate() chose its tokens from, recomputed without a cache: the model over each
    whole sequence, prompt then generated tokens, read at the positions that predicted them."""
    steps = generated.shape[1]
    sequences = write_rows(jnp.pad(prompts, ((0, 0), (0, steps))), generated, prompt_lengths)
    logits, _ = model(sequences, prompt_lengths + steps)
    positions = prompt_lengths[:, None] - 1 + jnp.arange(steps)[None]
    return jnp.take_along_axis(logits, positions[..., None], axis=1)


def byte_prompts(batch: int):
    """Prompts [B, T] int32 of different lengths, padded at the end, and their lengths [B]."""
    texts = [PROMPTS[b % len(PROMPTS)] for b in range(batch)]
    width = max(len(t) for t in texts)
    prompts = jnp.array([list(t) + [0] * (width - len(t)) for t in texts], jnp.int32)
    return prompts, jnp.array([len(t) for t in texts], jnp.int32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="new tokens per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=256, help="the cache's length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = Decoder(Config(max_len=args.max_len), nnx.Rngs(args.seed))
    prompts, prompt_lengths = byte_prompts(args.batch)
    generate(model, prompts, prompt_lengths, 2)  # compiles prefill and decode_step
    start = time.perf_counter()
    generated, logits = generate(model, prompts, prompt_lengths, args.steps)
    generated.block_until_ready()
    seconds = time.perf_counter() - start
    print(f"{jax.devices()[0].platform}: {args.batch} x {args.steps} tokens in {seconds:.3f} s, "
          f"{args.batch * args.steps / seconds:.0f} tokens/s (prefill included)")
    print("first continuation:", bytes(generated[0].tolist()))

    difference = float(jnp.max(jnp.abs(logits - full_sequence_logits(model, prompts, prompt_lengths, generated))))
    print(f"cached logits against the full recomputation: max |difference| {difference:.2e}")
    if difference > 1e-4:
        raise SystemExit("the cached decode disagrees with the full recomputation")


if __name__ == "__main__":
    main()
