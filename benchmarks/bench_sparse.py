"""Top-k sparse attention speed: jax_flashattn.sparse_attention and attn_dist against an XLA gather +
einsum implementation in the same dtype, same process.

    python benchmarks/bench_sparse.py                # DeepSeek V3.2 shapes: N 128, K 1, H 576, Hv 512, topk 2048
    python benchmarks/bench_sparse.py --cpu-smoke    # a tiny float32 run that works on a CPU (no CSV)

Each configuration gets fresh random indices (about 1 % padding with -1, causal bottom-right) and
inputs; every function is jitted and warmed up, then `--calls` back-to-back calls and one
block_until_ready make a round; the time is the median per-call time over `--rounds` rounds, the
implementations alternating round by round. FLOPs (FlashMLA's convention, invalid slots counted):
fwd 2·topk·(H + Hv) per query head; fwdbwd adds the backward's 2·topk·(3·H + 2·Hv);
attn_dist 2·topk·H. `jax_flashattn_xlabwd` is the fwdbwd pass with the backward in XLA operations
(JFA_SPARSE_BACKWARD=xla) instead of the default tensor-core kernels. Writes
benchmarks/results/<date>-<device>-sparse.csv (DESIGN.md's columns; seqlen is S, T is --queries).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn as jfa
from bench_attention import COLUMNS, round_ms, warm_up


def xla_sparse_attention(q, k, indices, Hv):
    """Gather, then softmax, in the input dtype with float32 softmax: the XLA peer (K = 1, V = k[..., :Hv])."""
    B, T, N, H = q.shape
    S = k.shape[1]
    valid = (indices >= 0) & (indices < S) & (indices <= jnp.arange(T)[None, :, None, None] + S - T)
    rows = jnp.take_along_axis(k[:, None, :, 0], jnp.clip(indices[:, :, 0], 0, S - 1)[..., None], axis=2)
    logits = jnp.einsum("btnh,btjh->btnj", q, rows, preferred_element_type=jnp.float32) * H ** -0.5
    logits = jnp.where(valid[:, :, 0][:, :, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("btnj,btjd->btnd", probs, rows[..., :Hv])


def passes(B, T, S, N, H, Hv, topk, dtype, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, 1, H), np.float32), dtype)
    pos = np.arange(T)[None, :, None, None] + S - T
    indices = (rng.random((B, T, 1, topk)) * (pos + 1)).astype(np.int32)
    indices[rng.random(indices.shape) < 0.01] = -1
    indices = jnp.asarray(indices)
    w = jnp.asarray(rng.standard_normal((B, T, N, Hv), np.float32), dtype)

    def ours(q, k):
        return jfa.sparse_attention(q, k, None, indices, value_head_dim=Hv, is_causal=True)

    def xla(q, k):
        return xla_sparse_attention(q, k, indices, Hv)

    def fwdbwd(fn):
        return jax.jit(jax.value_and_grad(lambda q, k: jnp.sum(fn(q, k).astype(jnp.float32) * w), argnums=(0, 1)))

    def with_xla_backward(fn):
        """Compiled now, with the backward in XLA operations (JFA_SPARSE_BACKWARD, read when traced)."""
        before = os.environ.get("JFA_SPARSE_BACKWARD")
        os.environ["JFA_SPARSE_BACKWARD"] = "xla"
        try:
            return fn.lower(q, k).compile()
        finally:
            if before is None:
                del os.environ["JFA_SPARSE_BACKWARD"]
            else:
                os.environ["JFA_SPARSE_BACKWARD"] = before

    _, lse = jfa.sparse_attention(q, k, None, indices, value_head_dim=Hv, is_causal=True, return_lse=True)

    def dist(q, k):
        return jfa.attn_dist(q, k, indices, lse, head_group=min(N, 64), is_causal=True)

    per_query = B * T * N * 2 * topk
    return [
        ("fwd", per_query * (H + Hv), {"jax_flashattn": jax.jit(ours), "xla": jax.jit(xla)}, (q, k)),
        ("fwdbwd", per_query * (4 * H + 3 * Hv), {"jax_flashattn": fwdbwd(ours), "xla": fwdbwd(xla),
                                                  "jax_flashattn_xlabwd": with_xla_backward(fwdbwd(ours))},
         (q, k)),
        ("attn_dist", per_query * H, {"jax_flashattn": jax.jit(dist)}, (q, k)),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--queries", type=int, default=1024, help="T, the query positions")
    parser.add_argument("--kv-lens", default="32768,65536")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder of the CSV")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        dtype, (B, T, N, H, Hv, topk), kv_lens = jnp.float32, (1, 16, 8, 64, 48, 32), [128]
    else:
        dtype, (B, T, N, H, Hv, topk) = jnp.bfloat16, (1, args.queries, 128, 576, 512, 2048)
        kv_lens = [int(s) for s in args.kv_lens.split(",")]
    device = jax.devices()[0].device_kind.replace(" ", "-").lower()
    rows = []
    for S in kv_lens:
        for name, flops, impls, inputs in passes(B, T, S, N, H, Hv, topk, dtype, seed=S):
            for fn in impls.values():
                warm_up(fn, inputs)
            times = {impl: [] for impl in impls}
            for _ in range(args.rounds):
                for impl, fn in impls.items():
                    times[impl].append(round_ms(fn, inputs, args.calls))
            for impl, ms in times.items():
                ms = float(np.median(ms))
                rows.append(dict(device=device, impl=impl, dtype=jnp.dtype(dtype).name, hdim=H, seqlen=S, batch=B,
                                 heads=N, kv_heads=1, causal=True, ms=round(ms, 4),
                                 tflops=round(flops / ms / 1e9, 2), **{"pass": name}))
                print(f"S={S:6d} {name:9s} {impl:14s} {ms:9.3f} ms {flops / ms / 1e9:8.2f} TFLOP/s")
    if args.cpu_smoke:
        return
    out = Path(args.out) / f"{datetime.date.today()}-{device}-sparse.csv"
    out.parent.mkdir(exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
