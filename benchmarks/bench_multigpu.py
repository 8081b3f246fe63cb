"""Several GPUs against one, same process: batch- and head-split training steps, and context parallelism.

    python benchmarks/bench_multigpu.py                        # every section, every GPU JAX sees
    python benchmarks/bench_multigpu.py --sections cp --seqlens 131072 524288
    python benchmarks/bench_multigpu.py --cpu-smoke            # 4 fake CPU devices, tiny shapes

Sections (bf16, H 128 unless told):
- `parallel`: the forward and backward of one attention layer (jax.vjp: the output and dQ, dK,
  dV, as a training step computes them; no loss, whose sum would be an all-reduce of its own) with
  the batch or the heads split over the n devices. Each device holds the single-GPU problem
  (`--parallel-batch` x `--parallel-seqlen`, N*H = 2048), so the per-GPU time should equal the
  single-GPU time; the compiled program's collectives are read from its HLO text (none expected).
- `cp`: `context_parallel_attention` (strategies ring and all_gather, load-balanced when causal)
  on one sequence of T tokens split over the n devices, forward and forward + backward, against
  `flash_attention` on one device with the whole sequence (where it fits), in the same rounds.
  The results are compared with the single-device call (relative L2 error of the output and of
  each gradient, after undoing the load-balanced layout).
Timing: every function is jitted and warmed up (compile + 1 call); a round is `calls`
back-to-back calls and one block_until_ready; the rounds alternate between the implementations of
one configuration; the median per-call time is reported.
Columns: `tflops` is per GPU (the whole problem's FLOPs, FlashAttention's count: forward
4*B*T*S*N*H, halved when causal, fwdbwd 3.5x, over the time and the number of GPUs);
`efficiency` = single-GPU time / (GPUs x time) at the same total problem (cp), or single-GPU time /
time at the same per-GPU problem (parallel); `collectives` lists the kinds in the compiled program;
`rel_err` the worst relative L2 error against the single-device result.
Writes benchmarks/results/<date>-<device>-x<n>-multigpu.csv; benchmarks/plot_multigpu.py draws the
cp section's efficiencies from one or more such files.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import sys
import time
from pathlib import Path

COLUMNS = ["device", "gpus", "section", "impl", "dtype", "hdim", "seqlen", "batch", "heads",
           "kv_heads", "causal", "pass", "ms", "tflops", "efficiency", "collectives", "rel_err"]
COLLECTIVE = re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", nargs="+", default=["parallel", "cp"], choices=["parallel", "cp"])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="0 and/or 1")
    p.add_argument("--parallel-batch", type=int, default=4)
    p.add_argument("--parallel-seqlen", type=int, default=4096)
    p.add_argument("--seqlens", nargs="+", type=int, default=[131072, 524288],
                   help="total sequence lengths of the cp section")
    p.add_argument("--cp-heads", type=int, default=8, help="query heads of the cp section")
    p.add_argument("--cp-kv-heads", type=int, default=None, help="K/V heads (default: as many)")
    p.add_argument("--strategies", nargs="+", default=["ring", "all_gather"])
    p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--single-max-seqlen", type=int, default=1 << 20,
                   help="longest T run on one device as the baseline and the reference")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--long-calls", type=int, default=1, help="calls per round from T >= 512k")
    p.add_argument("--long-rounds", type=int, default=3, help="rounds from T >= 512k")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--tag", default="", help="added to the CSV file name")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="4 fake CPU devices, float32, tiny shapes: checks that the script runs")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.dtype, args.hdim, args.parallel_batch, args.parallel_seqlen = "fp32", 32, 2, 128
        args.seqlens, args.cp_heads, args.rounds, args.calls = [512], 2, 2, 1
    return args


args = parse_args()
if args.cpu_smoke:  # before JAX starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the lent machines' rule: no NVLink multicast

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax_flashattn as jfa  # noqa: E402
from bench_attention import round_ms  # noqa: E402  (the same back-to-back timing)

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def collectives(compiled) -> str:
    return " ".join(sorted(set(COLLECTIVE.findall(compiled.as_text())))) or "none"


def vjp_step(attend):
    """(q, k, v, w) -> (out, dq, dk, dv): the forward and backward of one training step."""
    def step(q, k, v, w):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(w))
    return step


def relative_error(got, want) -> float:
    got, want = (jnp.asarray(jax.device_get(x), jnp.float32) for x in (got, want))
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


class Results:
    def __init__(self, args, devices):
        kind = "cpu" if args.cpu_smoke else devices[0].device_kind.lower().replace(" ", "-")
        self.device, self.gpus = kind, len(devices)
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        today = datetime.date.today().isoformat()
        tag = f"-{args.tag}" if args.tag else ""
        self.path = out_dir / f"{today}-{kind}-x{self.gpus}-multigpu{tag}.csv"
        self.file = open(self.path, "w", newline="")  # rows written as measured: a cut-off run keeps them
        self.writer = csv.writer(self.file)
        self.writer.writerow(COLUMNS)
        print(f"{'section':<9}{'impl':<12}{'T':>9}{'B':>4}{'N':>4}{'K':>4}{'causal':>7}{'pass':>8}"
              f"{'ms':>10}{'TFLOP/s/GPU':>12}{'eff':>7}{'rel_err':>10}  collectives")

    def add(self, **row):
        self.writer.writerow([self.device, self.gpus] + [row.get(c, "") for c in COLUMNS[2:]])
        self.file.flush()
        eff = f"{row['efficiency']:.3f}" if row.get("efficiency") != "" else "-"
        err = f"{row['rel_err']:.2e}" if row.get("rel_err") != "" else "-"
        print(f"{row['section']:<9}{row['impl']:<12}{row['seqlen']:>9}{row['batch']:>4}{row['heads']:>4}"
              f"{row['kv_heads']:>4}{row['causal']:>7}{row['pass']:>8}{row['ms']:>10.3f}"
              f"{row['tflops']:>12.1f}{eff:>7}{err:>10}  {row['collectives']}", flush=True)


def timed_rounds(fns, fn_args, rounds, calls):
    """Median per-call ms of each function, its rounds alternating with the others'."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(round_ms(fn, fn_args[name], calls))
    return {name: float(np.median(t)) for name, t in times.items()}


def random_qkvw(key, batch, seqlen, heads, kv_heads, hdim, dtype):
    kq, kk, kv, kw = jax.random.split(key, 4)
    return (jax.random.normal(kq, (batch, seqlen, heads, hdim), dtype),
            jax.random.normal(kk, (batch, seqlen, kv_heads, hdim), dtype),
            jax.random.normal(kv, (batch, seqlen, kv_heads, hdim), dtype),
            jax.random.normal(kw, (batch, seqlen, heads, hdim), dtype))


def parallel_section(args, devices, results):
    n, dtype, hdim = len(devices), DTYPES[args.dtype], args.hdim
    heads, batch, seqlen = max(1, 2048 // hdim), args.parallel_batch, args.parallel_seqlen
    mesh = Mesh(np.array(devices), ("d",))
    one = devices[0]
    for causal in map(bool, args.causal):
        attend = lambda q, k, v, c=causal: jfa.flash_attention(q, k, v, is_causal=c)  # noqa: E731
        step = jax.jit(vjp_step(attend))
        flops = 3.5 * 4 * batch * seqlen * seqlen * heads * hdim * (0.5 if causal else 1.0)
        key = jax.random.key(time.time_ns() % 2**31)
        single = [jax.device_put(x, one) for x in random_qkvw(key, batch, seqlen, heads, heads, hdim, dtype)]
        fns, fn_args, colls, errors = {"single": step}, {"single": single}, {"single": "none"}, {}
        for split, shape, spec in (("batch", (n * batch, seqlen, heads), P("d")),
                                   ("heads", (batch, seqlen, n * heads), P(None, None, "d"))):
            sharding = NamedSharding(mesh, spec)
            q, k, v, w = (jax.device_put(x, sharding) for x in random_qkvw(
                jax.random.fold_in(key, len(fns)), *shape, shape[2], hdim, dtype))
            compiled = step.lower(q, k, v, w).compile()
            fns[split], fn_args[split], colls[split] = compiled, (q, k, v, w), collectives(compiled)
            # The split call against the same call on one device (the whole problem fits one GPU).
            whole = [jax.device_put(x, one) for x in (q, k, v, w)]
            errors[split] = max(relative_error(a, b) for a, b in zip(compiled(q, k, v, w), step(*whole)))
            del whole
        for name, fn in fns.items():  # warm-up
            jax.block_until_ready(fn(*fn_args[name]))
        ms = timed_rounds(fns, fn_args, args.rounds, args.calls)
        for name in fns:
            gpus = 1 if name == "single" else n
            results.add(section="parallel", impl=name, dtype=args.dtype, hdim=hdim, seqlen=seqlen,
                        batch=batch * (gpus if name == "batch" else 1),
                        heads=heads * (gpus if name == "heads" else 1), kv_heads="", causal=int(causal),
                        **{"pass": "fwdbwd"}, ms=ms[name], tflops=flops / ms[name] / 1e9,
                        efficiency=ms["single"] / ms[name], collectives=colls[name],
                        rel_err=errors.get(name, ""))


def cp_functions(strategy, causal, mesh, pass_):
    seq = P(None, "seq")
    attend = jax.shard_map(
        lambda q, k, v: jfa.context_parallel_attention(q, k, v, axis_name="seq", strategy=strategy,
                                                       is_causal=causal),
        mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    if pass_ == "fwd":
        return jax.jit(lambda q, k, v, w: (attend(q, k, v),))
    return jax.jit(vjp_step(attend))


def cp_section(args, devices, results):
    n, dtype, hdim = len(devices), DTYPES[args.dtype], args.hdim
    heads = args.cp_heads
    kv_heads = args.cp_kv_heads or heads
    mesh = Mesh(np.array(devices), ("seq",))
    seq_sharding = NamedSharding(mesh, P(None, "seq"))
    one = devices[0]
    for seqlen in args.seqlens:
        long = seqlen >= 524288
        calls, rounds = (args.long_calls, args.long_rounds) if long else (args.calls, args.rounds)
        key = jax.random.key(time.time_ns() % 2**31)
        qkvw = random_qkvw(key, 1, seqlen, heads, kv_heads, hdim, dtype)
        for causal in map(bool, args.causal):
            # Causal calls take the load-balanced layout, applied once outside the timed calls.
            layout = (lambda x: jfa.load_balance(x, axis=1, n=n)) if causal else (lambda x: x)
            undo = (lambda x: jfa.load_balance(x, axis=1, n=n, inverse=True)) if causal else (lambda x: x)
            split = [jax.device_put(layout(x), seq_sharding) for x in qkvw]
            flops = 4 * seqlen * seqlen * heads * hdim * (0.5 if causal else 1.0)
            for pass_ in args.passes:
                fns, fn_args, colls = {}, {}, {}
                if seqlen <= args.single_max_seqlen:
                    attend = lambda q, k, v, c=causal: jfa.flash_attention(q, k, v, is_causal=c)  # noqa: E731
                    fns["single"] = (jax.jit(lambda q, k, v, w, a=attend: (a(q, k, v),)) if pass_ == "fwd"
                                     else jax.jit(vjp_step(attend)))
                    fn_args["single"], colls["single"] = [jax.device_put(x, one) for x in qkvw], "none"
                for strategy in args.strategies:
                    compiled = cp_functions(strategy, causal, mesh, pass_).lower(*split).compile()
                    fns[strategy], fn_args[strategy] = compiled, split
                    colls[strategy] = collectives(compiled)
                outs, errors = {}, {}
                for name, fn in fns.items():  # warm-up, keeping the results for the comparison
                    outs[name] = jax.block_until_ready(fn(*fn_args[name]))
                if "single" in outs:
                    for strategy in args.strategies:
                        errors[strategy] = max(relative_error(undo(got), want)
                                               for got, want in zip(outs[strategy], outs["single"]))
                del outs
                ms = timed_rounds(fns, fn_args, rounds, calls)
                pass_flops = flops * (3.5 if pass_ == "fwdbwd" else 1.0)
                for name in fns:
                    gpus = 1 if name == "single" else n
                    results.add(section="cp", impl=name, dtype=args.dtype, hdim=hdim, seqlen=seqlen,
                                batch=1, heads=heads, kv_heads=kv_heads, causal=int(causal),
                                **{"pass": pass_}, ms=ms[name], tflops=pass_flops / ms[name] / gpus / 1e9,
                                efficiency=(ms["single"] / (gpus * ms[name]) if "single" in ms else ""),
                                collectives=colls[name], rel_err=errors.get(name, ""))
                del fns, fn_args
            del split


def main():
    devices = jax.devices()
    print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}")
    if len(devices) < 2:
        raise SystemExit("bench_multigpu needs at least 2 devices")
    results = Results(args, devices)
    if "parallel" in args.sections:
        parallel_section(args, devices, results)
    if "cp" in args.sections:
        cp_section(args, devices, results)
    print(f"wrote {results.path}")


if __name__ == "__main__":
    main()
