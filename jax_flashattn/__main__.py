"""`python -m jax_flashattn`: what was built, a realistic attention checked against jax.nn, and
a small speed table, on whatever device JAX has. Exits 1 if an error is out of tolerance."""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn as jfa
from jax_flashattn.reference import attention_reference

# Relative-error bounds against the float32 reference (DESIGN.md), forward / gradients.
TOLERANCE = {"float32": (1e-5, 4e-5), "float16": (3e-3, 1.2e-2), "bfloat16": (2e-2, 8e-2)}


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _loss_fns(fn):
    def loss(q, k, v, w):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    return jax.jit(fn), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _time_ms(f, *args, reps):
    jax.block_until_ready(f(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def main(argv=None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2 if on_gpu else 1)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16 if on_gpu else 8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--reps", type=int, default=20 if on_gpu else 3)
    args = parser.parse_args(argv)

    info = jfa.build_info()
    print(f"jax_flashattn {jfa.__version__}  (jax {jax.__version__})")
    print(f"  built: CPU kernels yes; CUDA kernels "
          f"{info['cuda_variants'] if info['cuda'] else 'no (built without nvcc)'}")
    print(f"  device: {jax.devices()[0].device_kind} ({jax.default_backend()})")

    B, T, N, H, dtype = args.batch, args.seqlen, args.heads, args.head_dim, jnp.dtype(args.dtype)
    causal = not args.no_causal
    print(f"\nattention B={B} T=S={T} N={N} H={H} {dtype.name} causal={causal}")
    keys = jax.random.split(jax.random.key(int(time.time())), 4)
    q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32) for kk in keys[:3])
    w = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))

    ours = lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=causal)  # noqa: E731
    peer_impl = "cudnn" if on_gpu and dtype != jnp.float32 else "xla"
    peer = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal, implementation=peer_impl)
    ref = lambda q, k, v: attention_reference(q, k, v, is_causal=causal)[0]  # noqa: E731

    results = {}
    for name, fn, inputs in (("jax_flashattn", ours, (qd, kd, vd)),
                             (f"jax.nn {peer_impl}", peer, (qd, kd, vd)),
                             ("reference f32", ref, (q, k, v))):
        fwd, fwdbwd = _loss_fns(fn)
        out = fwd(*inputs)
        _, grads = fwdbwd(*inputs, w)
        results[name] = (out, grads, fwd, fwdbwd, inputs)

    ref_out, ref_grads = results["reference f32"][:2]
    fwd_tol, grad_tol = TOLERANCE[dtype.name]
    print(f"\nrelative error vs float32 reference (bound: ours <= max(2 x peer, {fwd_tol:g}) fwd, "
          f"{grad_tol:g} grads)")
    print(f"  {'impl':<16}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}")
    errors = {}
    for name in ("jax_flashattn", f"jax.nn {peer_impl}"):
        out, grads = results[name][:2]
        errors[name] = [_rel(out, ref_out)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
        print(f"  {name:<16}" + "".join(f"{e:>10.2e}" for e in errors[name]))
    ours_err, peer_err = errors["jax_flashattn"], errors[f"jax.nn {peer_impl}"]
    bounds = [max(2 * peer_err[0], fwd_tol)] + [max(2 * p, grad_tol) for p in peer_err[1:]]
    ok = all(np.isfinite(e) and e <= b for e, b in zip(ours_err, bounds))

    flops = 4 * B * T * T * N * H * (0.5 if causal else 1.0)
    print(f"\nspeed (median of {args.reps}; {jax.default_backend()}; TFLOP/s counts "
          f"{'half ' if causal else ''}the 4*B*T*S*N*H forward FLOPs, x3.5 for fwd+bwd)")
    print(f"  {'impl':<16}{'fwd ms':>10}{'TFLOP/s':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}")
    for name in ("jax_flashattn", f"jax.nn {peer_impl}"):
        _, _, fwd, fwdbwd, inputs = results[name]
        t_f = _time_ms(fwd, *inputs, reps=args.reps)
        t_fb = _time_ms(fwdbwd, *inputs, w, reps=args.reps)
        print(f"  {name:<16}{t_f:>10.2f}{flops / t_f / 1e9:>9.2f}{t_fb:>12.2f}"
              f"{3.5 * flops / t_fb / 1e9:>9.2f}")

    print("\nresult:", "OK" if ok else "ERROR OUT OF TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
