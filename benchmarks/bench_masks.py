"""Masks given as tensors: a boolean mask or a PackedMask against the same pattern without one, and
against jax.nn (cuDNN, XLA) and tokamax (its Mosaic GPU kernels) given the same boolean mask, in one
process.

    python benchmarks/bench_masks.py                    # bf16, T = S = 16k, H 64/128/256, N·H = 2048
    python benchmarks/bench_masks.py --cpu-smoke        # a tiny float32 run that works on a CPU

Masks (each [1, 1, T, S], shared by the batch and the heads):
  none          no mask (the dense reference time)
  causal        is_causal=True (the reference for the causal tensor)
  causal_tensor the causal pattern as a boolean mask (packed inside the call, packing timed)
  block10/50    block_mask of 128 x 128 blocks, 10 % / 50 % of them kept at random (jax_flashattn
                gets the PackedMask; jax.nn the equivalent boolean mask)
  random50      every element kept with probability 0.5 (every tile partial)
Passes: fwd, and fwdbwd (grad of the sum of the output with respect to q, k, v). Every function
jitted and warmed up; a round is back-to-back calls and one block_until_ready: `--calls`, or as many
as make the round last `--min-round-ms` where one call is shorter (a round's first dispatch and its
final wait would otherwise weigh on short calls; docs/performance.md, masks); medians of `--rounds`
rounds, the implementations of one row alternating within each round.
Writes benchmarks/results/<date>-<device>-masks.csv (ms, and the ratio to the row's reference:
`none` for block and random masks, `causal` for the causal tensor).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn as jfa
from bench_attention import import_tokamax
from bench_decode import timed  # the same back-to-back timing

MASKS = ["none", "causal", "causal_tensor", "block10", "block50", "random50"]
IMPLS = ["jax_flashattn", "cudnn", "tokamax", "xla"]
BLOCK = 128


def boolean_mask(name, T, S, seed=0):
    """The [1, 1, T, S] boolean mask of `name` (None for none / causal), and for block masks the
    block grid."""
    rng = np.random.default_rng(seed)
    if name == "causal_tensor":
        return jnp.asarray((np.arange(S)[None] <= np.arange(T)[:, None])[None, None]), None
    if name.startswith("block"):
        keep = int(name[5:]) / 100
        blocks = rng.random((1, 1, -(-T // BLOCK), -(-S // BLOCK))) < keep
        dense = np.repeat(np.repeat(blocks, BLOCK, axis=2), BLOCK, axis=3)[..., :T, :S]
        return jnp.asarray(dense), jnp.asarray(blocks)
    if name == "random50":
        return jnp.asarray(rng.integers(0, 2, (1, 1, T, S), dtype=np.uint8).astype(bool)), None
    return None, None


def make_fn(impl, name, T, S, passes):
    dense, blocks = boolean_mask(name, T, S)
    causal = name == "causal"
    if impl == "jax_flashattn":
        mask = jfa.block_mask(blocks, BLOCK, q_len=T, kv_len=S) if blocks is not None else dense
        attend = lambda q, k, v: jfa.flash_attention(q, k, v, mask=mask, is_causal=causal)  # noqa: E731
    elif impl == "tokamax":
        tokamax = import_tokamax()
        attend = lambda q, k, v: tokamax.dot_product_attention(  # noqa: E731
            q, k, v, mask=dense, is_causal=causal, implementation="mosaic")
    else:
        attend = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, mask=dense, is_causal=causal, implementation=impl)
    if passes == "fwd":
        return jax.jit(attend)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdims", default="128,64,256")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--min-round-ms", type=float, default=20.0)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.cpu_smoke:
        a.hdims, a.seqlen, a.impls, a.rounds, a.calls, a.min_round_ms = "32", 256, "jax_flashattn,xla", 1, 1, 0.0
    dtype = jnp.float32 if a.cpu_smoke else jnp.bfloat16
    device = jax.devices()[0]
    tag = device.device_kind.lower().replace(" ", "-") if device.platform == "gpu" else "cpu"
    rows = []
    out = Path(a.out) if a.out else (Path(__file__).parent / "results" /
                                     f"{datetime.date.today().isoformat()}-{tag}-masks.csv")

    def write_rows():  # after each head dim, so that a run cut short keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)

    for H in (int(h) for h in a.hdims.split(",")):
        T = S = a.seqlen
        N = max(1, 2048 // H) if not a.cpu_smoke else 2
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (1, T, N, H), dtype) for kk in keys)
        for passes in a.passes.split(","):
            fns = {}
            for name in a.masks.split(","):
                for impl in a.impls.split(","):
                    if impl == "xla" and T * S > 4096 * 4096 and name != "none":
                        continue  # XLA's T x S logits per head would not fit
                    try:
                        fn = make_fn(impl, name, T, S, passes)
                        jax.block_until_ready(fn(q, k, v))
                        fns[(name, impl)] = fn
                    except Exception as e:  # a peer that refuses the call: no row
                        print(f"skip {impl} {name} H {H} {passes}: {type(e).__name__}: {str(e)[:120]}")
            calls = {key: max(a.calls, math.ceil(a.min_round_ms / timed(fn, (q, k, v), 1))) for key, fn in fns.items()}
            times = {key: [] for key in fns}
            for _ in range(a.rounds):
                for key, fn in fns.items():
                    times[key].append(timed(fn, (q, k, v), calls[key]))
            med = {key: float(np.median(t)) for key, t in times.items()}
            for (name, impl), ms in med.items():
                ref = "causal" if name in ("causal", "causal_tensor") else "none"
                base = med.get((ref, impl))
                ratio = base / ms if base else float("nan")
                rows.append(dict(device=tag, H=H, T=T, N=N, passes=passes, mask=name, impl=impl,
                                 ms=round(ms, 4), speed_vs_reference=round(ratio, 3), calls=calls[(name, impl)]))
                print(f"H {H:3d} {passes:6s} {name:14s} {impl:14s} {ms:9.3f} ms  x{ratio:.3f} of {ref}")
            write_rows()
    print("wrote", out)


if __name__ == "__main__":
    main()
