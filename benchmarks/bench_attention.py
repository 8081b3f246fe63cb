"""Attention speed: jax_flashattn against jax.nn (cuDNN, XLA), flash_attn3_jax and tokamax, same process.

    python benchmarks/bench_attention.py            # the FlashAttention sweep (DESIGN.md) + GQA rows
    python benchmarks/bench_attention.py --quick    # T = S in {1k, 4k, 16k}, fwd and fwdbwd
    python benchmarks/bench_attention.py --cpu-smoke  # a tiny float32 run that works on a CPU

Sweep: bf16, B*T = 16384, N*H = 2048 (H 64/128/256), T = S, causal and not; GQA rows N=16, K=2,
H=128. Each configuration gets fresh random inputs (never zeros). Timing: every function is jitted
and warmed up (compile + 2 calls); then `--calls` back-to-back calls followed by one
block_until_ready make a round, and the reported time is the median per-call time over `--rounds`
rounds. The rounds of one (configuration, pass) alternate between the implementations.
fwd times the forward alone; bwd times the pullback of jax.vjp (taken once, outside the
timed region) on a random cotangent; fwdbwd times jit(value_and_grad) of sum(out * w).
FLOPs: forward 4*B*T*S*N*H, halved when causal; bwd 2.5x, fwdbwd 3.5x the forward.
Peers: cudnn and xla (jax.nn.dot_product_attention), fa3 (flash_attn3_jax.flash_mha, head dims up to
128), tokamax (tokamax.dot_product_attention(..., implementation='mosaic'), Google's Pallas
Mosaic-GPU kernels; its package imports xprof only for its own profiling helpers, so a stub stands in
where xprof is not installed).
Impls jax_flashattn (the default dispatch: the Hopper kernels on sm90) and jax_flashattn_sm80 (the
portable kernels: JFA_FORCE_SM80=1 is set while that impl is compiled and timed; the extension reads
it at each dispatch, and each impl has its own jitted functions); jax_flashattn_dropout is the default
dispatch with dropout_rate=0.1 (no peer has dropout through JAX; FLOPs counted as without it), and
jax_flashattn_lengths passes key lengths equal to S, which hide nothing but take the general (masked)
kernels: their own cost.
Writes benchmarks/results/<date>-<device>.csv (columns of DESIGN.md) and a PNG next to it.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

COLUMNS = ["device", "impl", "dtype", "hdim", "seqlen", "batch", "heads", "kv_heads", "causal",
           "pass", "ms", "tflops"]
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def import_tokamax():
    """tokamax, with empty xprof modules in place where xprof is missing: tokamax's top-level
    import reaches xprof only for its profiling helpers, which the benchmark never calls."""
    try:
        import xprof  # noqa: F401
    except ImportError:
        import types
        for module in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(module, types.ModuleType(module))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    import tokamax
    return tokamax


def attention_impls(names):
    """name -> attention(q, k, v, is_causal) for the implementations that import here."""
    impls = {}
    for name in names:
        if name in ("jax_flashattn", "jax_flashattn_sm80", "jax_flashattn_dropout", "jax_flashattn_lengths"):
            try:
                import jax_flashattn as jfa
            except ImportError as e:
                print(f"skipping {name}: {e}")
                continue
            # _dropout: rate 0.1 (the peers have no dropout through JAX); the same useful FLOPs.
            drop = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)) if name.endswith("_dropout") else {}
            # _lengths: key lengths of S (they hide nothing): the general (masked) kernels' own cost.
            lengths = name.endswith("_lengths")
            impls[name] = lambda q, k, v, c, jfa=jfa, drop=drop, lengths=lengths: jfa.flash_attention(
                q, k, v, is_causal=c, **drop, **(dict(key_value_seq_lengths=jnp.full(
                    (q.shape[0],), k.shape[1], jnp.int32)) if lengths else {}))
        elif name in ("cudnn", "xla"):
            impls[name] = lambda q, k, v, c, impl=name: jax.nn.dot_product_attention(
                q, k, v, is_causal=c, implementation=impl)
        elif name == "fa3":
            try:
                from flash_attn3_jax import flash_mha
            except ImportError as e:
                print(f"skipping fa3: {e}")
                continue
            impls[name] = lambda q, k, v, c, f=flash_mha: f(q, k, v, is_causal=c)
        elif name == "tokamax":
            try:
                tokamax = import_tokamax()
            except ImportError as e:
                print(f"skipping tokamax: {e}")
                continue
            impls[name] = lambda q, k, v, c, t=tokamax: t.dot_product_attention(
                q, k, v, is_causal=c, implementation="mosaic")
        else:
            raise SystemExit(f"unknown impl {name!r}")
    return impls


@contextlib.contextmanager
def forced_portable(name):
    """JFA_FORCE_SM80=1 while the jax_flashattn_sm80 rows run; the caller's setting otherwise."""
    if name != "jax_flashattn_sm80":
        yield
        return
    old = os.environ.get("JFA_FORCE_SM80")
    os.environ["JFA_FORCE_SM80"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["JFA_FORCE_SM80"]
        else:
            os.environ["JFA_FORCE_SM80"] = old


def warm_up(fn, args) -> None:
    jax.block_until_ready(fn(*args))  # compile
    for _ in range(2):
        jax.block_until_ready(fn(*args))


def round_ms(fn, args, calls) -> float:
    """Per-call time of `calls` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / calls


def pass_functions(attn, causal):
    """jitted (fwd, bwd, fwdbwd) callables and how to build their arguments from (q, k, v, w)."""
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, causal))
    pullback = jax.jit(lambda vjp_fn, do: vjp_fn(do))
    fwdbwd = jax.jit(jax.value_and_grad(
        lambda q, k, v, w: jnp.sum(attn(q, k, v, causal).astype(jnp.float32) * w),
        argnums=(0, 1, 2)))

    def args(pass_, q, k, v, w):
        if pass_ == "fwd":
            return fwd, (q, k, v)
        if pass_ == "bwd":
            _, vjp_fn = jax.vjp(lambda q, k, v: attn(q, k, v, causal), q, k, v)
            return pullback, (vjp_fn, w.astype(q.dtype))
        return fwdbwd, (q, k, v, w)
    return args


def configurations(args):
    for hdim in [] if args.gqa_only else args.hdims:
        heads = 2048 // hdim
        for seqlen in args.seqlens:
            yield hdim, seqlen, max(1, args.tokens // seqlen), heads, heads
    if args.gqa:
        for seqlen in (2048, 8192):
            yield 128, seqlen, max(1, args.tokens // seqlen), 16, 2


def run(args) -> Path:
    device = jax.devices()[0]
    dtype = DTYPES[args.dtype]
    impls = attention_impls(args.impls)
    today = datetime.date.today().isoformat()
    device_name = device.device_kind.lower().replace(" ", "-")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"{today}-{device_name}.csv"
    csv_file = open(csv_path, "w", newline="")  # rows are written as measured: a cut-off run keeps them
    writer = csv.writer(csv_file)
    writer.writerow(COLUMNS)
    rows = 0
    print(f"{device.device_kind}: {', '.join(impls)}; {args.dtype}; passes {','.join(args.passes)}")
    print(f"{'impl':<16}{'H':>5}{'T=S':>7}{'B':>4}{'N':>4}{'K':>4}{'causal':>7}{'pass':>8}"
          f"{'ms':>10}{'TFLOP/s':>9}")
    for hdim, seqlen, batch, heads, kv_heads in configurations(args):
        key = jax.random.key(time.time_ns() % 2**31)
        kq, kk, kv, kw = jax.random.split(key, 4)
        q = jax.random.normal(kq, (batch, seqlen, heads, hdim), dtype)
        k = jax.random.normal(kk, (batch, seqlen, kv_heads, hdim), dtype)
        v = jax.random.normal(kv, (batch, seqlen, kv_heads, hdim), dtype)
        w = jax.random.normal(kw, (batch, seqlen, heads, hdim), jnp.float32)
        for causal in args.causal:
            flops = 4 * batch * seqlen * seqlen * heads * hdim * (0.5 if causal else 1.0)
            for pass_ in args.passes:
                # Every implementation is compiled and warmed up first; then the rounds alternate
                # between them, so that clock and temperature drift within the run reach all alike.
                ready = {}
                for name, attn in impls.items():
                    if name == "fa3" and hdim > 128:
                        continue  # flash_attn3_jax's wheel has head dims <= 128 only
                    if name == "xla" and seqlen > args.xla_max_seqlen:
                        continue  # XLA materialises B*N*T*S logits: slow and huge at long T
                    try:
                        with forced_portable(name):
                            fn, fn_args = pass_functions(attn, causal)(pass_, q, k, v, w)
                            warm_up(fn, fn_args)
                    except Exception as e:  # unsupported shape, OOM: report and go on
                        print(f"{name:<16}{hdim:>5}{seqlen:>7} causal={causal} {pass_}: "
                              f"failed: {str(e).splitlines()[0][:100]}")
                        continue
                    ready[name] = (fn, fn_args, [])
                for _ in range(args.rounds):
                    for name, (fn, fn_args, times) in ready.items():
                        with forced_portable(name):
                            times.append(round_ms(fn, fn_args, args.calls))
                for name, (_, _, times) in ready.items():
                    ms = float(np.median(times))
                    tflops = PASS_FLOPS[pass_] * flops / (ms * 1e9)
                    writer.writerow([device.device_kind, name, args.dtype, hdim, seqlen, batch,
                                     heads, kv_heads, int(causal), pass_, f"{ms:.3f}",
                                     f"{tflops:.1f}"])
                    csv_file.flush()
                    rows += 1
                    print(f"{name:<16}{hdim:>5}{seqlen:>7}{batch:>4}{heads:>4}{kv_heads:>4}"
                          f"{int(causal):>7}{pass_:>8}{ms:>10.3f}{tflops:>9.1f}", flush=True)
                del ready
        del q, k, v, w
        gc.collect()

    csv_file.close()
    print(f"wrote {csv_path} ({rows} rows)")
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plot_results import plot_csv
        print(f"wrote {plot_csv(csv_path)}")
    except ImportError as e:
        print(f"no plot ({e}); draw it later with benchmarks/plot_results.py {csv_path}")
    return csv_path


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impls", type=lambda s: s.split(","),
                   default=["jax_flashattn", "cudnn", "fa3", "tokamax", "xla"])
    p.add_argument("--xla-max-seqlen", type=int, default=4096,
                   help="skip the xla peer above this T (it builds T x S logits)")
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--passes", type=lambda s: s.split(","), default=["fwd", "bwd", "fwdbwd"])
    p.add_argument("--causal", type=lambda s: [bool(int(x)) for x in s.split(",")],
                   default=[False, True], help="e.g. 0,1")
    p.add_argument("--gqa", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gqa-only", action="store_true", help="only the GQA rows")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", type=int, default=16384, help="B*T of the sweep")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--quick", action="store_true", help="T = S in 1k,4k,16k; fwd, fwdbwd")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny float32 sweep for a CPU")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.passes = [1024, 4096, 16384], ["fwd", "fwdbwd"]
    if args.cpu_smoke:
        args.impls, args.hdims, args.seqlens = ["jax_flashattn", "xla"], [64], [256, 512]
        args.dtype, args.tokens, args.gqa, args.calls, args.rounds = "fp32", 512, False, 2, 3
    return args


if __name__ == "__main__":
    run(parse_args())
