"""One attention forward, called a few times, for a profiler (ncu) to look at a single kernel.

    ncu --kernel-name regex:<name> --launch-skip 3 --launch-count 1 \
        python benchmarks/profile_forward.py fa3 --hdim 128 --seqlen 1024 --causal

The configuration is bench_attention.py's sweep: bf16, B*T = 16384, N*H = 2048, T = S. Impls:
jax_flashattn, fa3 (flash_attn3_jax), cudnn (jax.nn). Calls: 1 to compile, then --calls more,
each waited for, so that the profiled launch is a steady-state one of the same program.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


def attention(impl):
    if impl == "jax_flashattn":
        import jax_flashattn as jfa
        return lambda q, k, v, c: jfa.flash_attention(q, k, v, is_causal=c)
    if impl == "fa3":
        from flash_attn3_jax import flash_mha
        return lambda q, k, v, c: flash_mha(q, k, v, is_causal=c)
    if impl == "cudnn":
        return lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn")
    raise SystemExit(f"unknown impl {impl!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impl", choices=["jax_flashattn", "fa3", "cudnn"])
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    heads, batch = 2048 // args.hdim, max(1, 16384 // args.seqlen)
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (batch, args.seqlen, heads, args.hdim)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    fwd = jax.jit(lambda q, k, v: attention(args.impl)(q, k, v, args.causal))
    for _ in range(1 + args.calls):
        jax.block_until_ready(fwd(q, k, v))
    print(f"{args.impl}: B={batch} T=S={args.seqlen} N={heads} H={args.hdim} causal={int(args.causal)} done")


if __name__ == "__main__":
    main()
