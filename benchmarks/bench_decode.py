"""Decoding speed: a few new queries against a long KV cache, jax_flashattn against jax.nn (cuDNN,
XLA) in the same process.

    python benchmarks/bench_decode.py              # the rows below, bf16, N 32, K 8, H 128
    python benchmarks/bench_decode.py --cpu-smoke  # a tiny float32 run that works on a CPU
    python benchmarks/bench_decode.py --rows "8,1,32768;1,1,131072" --impls jax_flashattn,cudnn

Rows (B, T, S): (8, 1, 8k), (8, 1, 32k), (8, 16, 32k), (1, 1, 128k), (32, 1, 8k), (8, 4, 16k);
bottom-right causal (the T queries are the cache's last positions). jax.nn gets the equivalent
call: no mask for T = 1 (the query sees the whole cache), else the bottom-right causal mask as a
boolean [1, 1, T, S]. Impls: jax_flashattn (the default dispatch, which splits the keys for such
calls: jax_flashattn/decode.py), jax_flashattn_nosplit (JFA_DECODE_SPLIT=0 while it is traced),
jax_flashattn_paged16, _paged64, _paged128 and _paged256 (paged_attention over the same cache cut
into pages of 16, 64, 128 or 256 rows in shuffled order, every row valid: on a Hopper GPU the
kernel reads them in place, elsewhere they are gathered into a contiguous cache first),
jax_flashattn_paged64gather and _paged256gather (those pages gathered as on other GPUs, for an A/B
in one process), cudnn and xla, and hbm_read: no attention, K and V each summed by an XLA
reduction, the rate at which this GPU reads those bytes at all (the others' rates are read against
it). Every function jitted and warmed up; a round is `--calls` back-to-back calls and one
block_until_ready; the median per-call time over `--rounds` rounds, the rounds of one row
alternating between the implementations. Rate: bytes of K and V read per second (the paged rows
too: their gather's extra traffic is not counted).
Writes benchmarks/results/<date>-<device>-decode.csv.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn as jfa

ROWS = [(8, 1, 8192), (8, 1, 32768), (8, 16, 32768), (1, 1, 131072), (32, 1, 8192), (8, 4, 16384)]
IMPLS = ["jax_flashattn", "jax_flashattn_nosplit", "jax_flashattn_paged16", "jax_flashattn_paged64",
         "jax_flashattn_paged128", "jax_flashattn_paged256", "jax_flashattn_paged64gather",
         "jax_flashattn_paged256gather", "cudnn", "xla", "hbm_read"]


def paged(k, v, page_size, seed):
    """The [B, S, K, H] cache as a shuffled pool of pages, its block table and lengths."""
    B, S = k.shape[:2]
    pages = B * (S // page_size)
    slot = np.random.default_rng(seed).permutation(pages)  # the pool slot of each page, in cache order
    pool = lambda x: x.reshape((pages, page_size) + x.shape[2:])[np.argsort(slot)]  # noqa: E731
    return pool(k), pool(v), jnp.asarray(slot.reshape(B, -1), jnp.int32), jnp.full((B,), S, jnp.int32)


def make_fn(impl, T, S, q, k, v):
    """(jitted function, its arguments)."""
    if impl.startswith("jax_flashattn_paged"):
        fn = jax.jit(lambda q, kp, vp, table, lengths: jfa.paged_attention(q, kp, vp, table, lengths,
                                                                        is_causal=True))
        gather = impl.endswith("gather")
        args = (q,) + paged(k, v, int(impl[len("jax_flashattn_paged"):].removesuffix("gather")), S)
        in_place = jfa.paged._hopper_reads_pages
        if gather:  # compiled while the in-place path is off
            jfa.paged._hopper_reads_pages = lambda *a: False
        try:
            return fn.lower(*args).compile(), args
        finally:
            jfa.paged._hopper_reads_pages = in_place
    if impl == "hbm_read":  # every byte read once, two floats written
        total = lambda x: x.astype(jnp.float32).sum()  # noqa: E731
        return jax.jit(lambda k, v: (total(k), total(v))), (k, v)
    if impl.startswith("jax_flashattn"):
        fn = jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True,
                                                          causal_alignment="bottom_right"))
        return fn, (q, k, v)
    mask = None if T == 1 else (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + S - T)[None, None]
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl))
    return fn, (q, k, v)


def timed(fn, args, calls):
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rows", default=None,
                        help="B,T,S triples separated by ';' (default: the rows above)")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", default=None, help="the CSV file, or a folder for it")
    a = parser.parse_args()
    N, K, H = (4, 2, 32) if a.cpu_smoke else (32, 8, 128)
    dtype = jnp.float32 if a.cpu_smoke else jnp.bfloat16
    rows = [(2, 1, 1024)] if a.cpu_smoke else ROWS
    if a.rows:
        rows = [tuple(int(x) for x in row.split(",")) for row in a.rows.split(";")]
    impls = ["jax_flashattn", "jax_flashattn_paged64", "jax_flashattn_paged256", "xla", "hbm_read"] if a.cpu_smoke \
        else a.impls.split(",")
    device = jax.devices()[0].device_kind.replace(" ", "-").lower()
    name = f"{datetime.date.today()}-{device}-decode.csv"
    out_path = Path(a.out) if a.out else Path(__file__).parent / "results" / name
    if out_path.is_dir():  # a folder, as bench_attention.py's --out
        out_path = out_path / name
    results = []
    for B, T, S in rows:
        keys = jax.random.split(jax.random.key(B * T + S), 3)
        q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32).astype(dtype)
        k = jax.random.normal(keys[1], (B, S, K, H), jnp.float32).astype(dtype)
        v = jax.random.normal(keys[2], (B, S, K, H), jnp.float32).astype(dtype)
        fns = {}
        for impl in impls:
            os.environ["JFA_DECODE_SPLIT"] = "0" if impl == "jax_flashattn_nosplit" else "1"
            try:
                fns[impl] = make_fn(impl, T, S, q, k, v)
                for _ in range(2):
                    jax.block_until_ready(fns[impl][0](*fns[impl][1]))
            except Exception as e:  # a peer that does not take the shape
                print(f"{impl} B={B} T={T} S={S}: skipped ({type(e).__name__}: {str(e)[:80]})")
                fns.pop(impl, None)
        os.environ.pop("JFA_DECODE_SPLIT", None)
        times = {impl: [] for impl in fns}
        for _ in range(a.rounds):
            for impl, (fn, args) in fns.items():
                times[impl].append(timed(fn, args, a.calls))
        kv_bytes = 2 * B * S * K * H * jnp.dtype(dtype).itemsize
        for impl, ts in times.items():
            ms = float(np.median(ts))
            gbs = kv_bytes / (ms * 1e-3) / 1e9
            results.append(dict(device=device, impl=impl, batch=B, queries=T, keys=S, heads=N, kv_heads=K,
                                hdim=H, ms=round(ms, 4), kv_gb_per_s=round(gbs, 1)))
            print(f"B={B:3d} T={T:3d} S={S:7d} {impl:24s} {ms:8.3f} ms {gbs:8.0f} GB/s", flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
