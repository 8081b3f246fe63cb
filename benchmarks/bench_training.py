"""A training step in a real client: a byte-level GPT in flax.nnx trained with each attention.

    python benchmarks/bench_training.py                 # 4 layers, d 1024, 16 heads, T 2048, bf16
    python benchmarks/bench_training.py --cpu-smoke     # a tiny float32 run that works on a CPU

The model: byte embedding, `--layers` pre-LayerNorm blocks (causal nnx.MultiHeadAttention, a GELU MLP
of 4·d), a final LayerNorm and a byte classifier; parameters float32, compute in `--dtype`; AdamW.
It is trained on this repository's own text (README, sources), so that the loss falls. Every
attention (`--impls`: jax_flashattn through jax_flashattn.flax.attention_fn, jax.nn's cudnn and xla
implementations) starts from the same initial weights and sees the same batches; the steps of the
implementations alternate (step i of each, then step i + 1), so that clock drift reaches all alike.
Causality comes as `is_causal=True`, or, for an impl named with `+mask` (say `jax_flashattn+mask`),
as Flax's idiom: `nnx.make_causal_mask(tokens)`, a dense float32 [B, 1, T, T] mask given to every
layer (cast to bool for jax.nn, which takes boolean masks only).

Reports per implementation the median step time over the steps after `--warmup`, and the largest
relative difference of its loss curve from the first implementation's. Writes
benchmarks/results/<date>-<device>-training.csv (impl, step, loss, ms).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def attention_function(name):
    """A flax attention_fn for `name`, causal whatever Flax passes: newer flax.nnx passes its own
    `is_causal` (False unless the module is called with it), older versions pass none. With
    `+mask` the mask that the model passes is the causality."""
    name, _, how = name.partition("+")
    if name == "jax_flashattn":
        from jax_flashattn.flax import attention_fn as base
    else:
        def base(query, key, value, bias=None, mask=None, *, is_causal=False, **unused):
            mask = None if mask is None else mask.astype(bool)
            return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal,
                                                implementation=name)

    if how == "mask":
        return base

    def causal(query, key, value, *args, **keywords):
        return base(query, key, value, *args, **dict(keywords, is_causal=True))
    return causal


def build_model(args, attention_fn, causal_mask):
    from flax import nnx

    dtype = DTYPES[args.dtype]
    d, heads = args.width, args.heads

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, dtype=dtype,
                                               attention_fn=attention_fn, rngs=rngs)
            self.norm2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.norm1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(256, d, dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(args.layers)]) if hasattr(nnx, "List") else [
                Block(rngs) for _ in range(args.layers)]
            self.norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.head = nnx.Linear(d, 256, dtype=dtype, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            mask = nnx.make_causal_mask(tokens) if causal_mask else None
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.norm(x))

    return GPT(nnx.Rngs(args.seed))


def corpus_batches(args):
    """`--steps` batches of (tokens, next tokens), [B, T] int32, cut from this repository's text."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(p for pattern in ("*.md", "**/*.py", "**/*.h", "**/*.cc", "**/*.cu") for p in root.glob(pattern)
                   if ".git" not in p.parts and "results" not in p.parts)
    data = np.frombuffer(b"\n".join(p.read_bytes() for p in files), np.uint8)
    need = args.seqlen + 1
    if data.size < 2 * need:
        data = np.resize(data, 2 * need)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.steps):
        starts = rng.integers(0, data.size - need, args.batch)
        chunk = np.stack([data[s:s + need] for s in starts]).astype(np.int32)
        yield jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])


def trainer(args, name):
    """(params, optimizer state, jitted step) for implementation `name`."""
    import optax
    from flax import nnx

    model = build_model(args, attention_function(name), causal_mask=name.endswith("+mask"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(args.lr, weight_decay=0.01)

    def loss_fn(params, tokens, targets):
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    @jax.jit
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return [params, tx.init(params), step]


def run(args):
    device = jax.devices()[0]
    states = {name: trainer(args, name) for name in args.impls}
    losses = {name: [] for name in args.impls}
    times = {name: [] for name in args.impls}
    print(f"{device.device_kind}: {', '.join(args.impls)}; {args.layers} layers, d {args.width}, "
          f"{args.heads} heads, B {args.batch}, T {args.seqlen}, {args.dtype}")
    for i, (tokens, targets) in enumerate(corpus_batches(args)):
        for name, state in states.items():
            start = time.perf_counter()
            state[0], state[1], loss = state[2](state[0], state[1], tokens, targets)
            loss = float(loss)  # waits for the step
            times[name].append((time.perf_counter() - start) * 1e3)
            losses[name].append(loss)
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  " + "  ".join(f"{n} {losses[n][-1]:.4f}" for n in args.impls), flush=True)

    first = args.impls[0]
    today = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{today}-{device.device_kind.lower().replace(' ', '-')}-training.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["device", "impl", "step", "loss", "ms"])
        for name in args.impls:
            for i, (loss, ms) in enumerate(zip(losses[name], times[name])):
                writer.writerow([device.device_kind, name, i, f"{loss:.6f}", f"{ms:.3f}"])
    print(f"{'impl':<22}{'step ms':>10}{'vs ' + first:>12}{'max rel loss diff':>20}")
    base_ms = float(np.median(times[first][args.warmup:]))
    for name in args.impls:
        ms = float(np.median(times[name][args.warmup:]))
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses[first]))
        print(f"{name:<22}{ms:>10.2f}{base_ms / ms:>11.3f}x{diff:>20.2e}")
    print(f"wrote {path}")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impls", type=lambda s: s.split(","), default=["jax_flashattn", "cudnn", "xla"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the step time (compilation)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny float32 run for a CPU")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.impls, args.layers, args.width, args.heads = ["jax_flashattn", "jax_flashattn+mask", "xla"], 1, 64, 2
        args.batch, args.seqlen, args.dtype, args.steps, args.warmup = 2, 64, "fp32", 4, 1
    return args


if __name__ == "__main__":
    run(parse_args())
