"""jax.export of programs that call jax_flashattn: with export_disabled_checks() they serialize,
and the deserialized program (forward and VJP) computes what the jitted function does, in this
process and in a fresh one that imports jax_flashattn; without the import, or under another
release, the call fails by naming the missing target instead of running something else."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_flashattn as jfa
from jax_flashattn import _ext
from util import fresh_seed

pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers")


def _dense_problem(seed):
    rng = np.random.default_rng(seed)
    B, T, S, N, K, H = 2, 29, 41, 4, 2, 32
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    q, k, v = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, H)
    bias = normal(1, N, T, S)
    mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.8)

    def attention(q, k, v, bias, mask):
        return jfa.flash_attention(q, k, v, bias=bias, mask=mask, softcap=30.0, is_causal=True,
                                   causal_alignment="bottom_right")
    return attention, (q, k, v, bias, mask)


def _sparse_problem(seed):
    rng = np.random.default_rng(seed)
    B, T, S, N, K, H, topk = 1, 17, 40, 4, 1, 32, 12
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    q, k, v = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, H)
    indices = jnp.asarray(rng.integers(-1, S, (B, T, K, topk)).astype(np.int32))

    def attention(q, k, v, indices):
        out, lse = jfa.sparse_attention(q, k, v, indices, is_causal=True, return_lse=True)
        return out + jnp.sum(jfa.attn_dist(q, k, indices, lse, head_group=2))
    return attention, (q, k, v, indices)


def _round_trip(fn, args):
    exported = export.export(jax.jit(fn), disabled_checks=jfa.export_disabled_checks())(*args)
    return export.deserialize(exported.serialize(vjp_order=1))


@pytest.mark.parametrize("problem", [_dense_problem, _sparse_problem], ids=["dense", "sparse"])
def test_deserialized_program_matches_the_jitted_one(problem):
    fn, args = problem(fresh_seed())
    restored = _round_trip(fn, args)
    assert restored.platforms == ("cpu",)
    np.testing.assert_array_equal(np.asarray(restored.call(*args)), np.asarray(jax.jit(fn)(*args)))

    float_args = 3  # q, k, v: the differentiated operands
    def with_rest(call):
        return lambda *x: call(*x, *args[float_args:])
    out, vjp = jax.vjp(with_rest(restored.call), *args[:float_args])
    cotangent = jnp.asarray(np.random.default_rng(fresh_seed()).standard_normal(out.shape, np.float32))
    want = jax.vjp(with_rest(fn), *args[:float_args])[1](cotangent)
    for got, expected in zip(vjp(cotangent), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_export_needs_the_disabled_checks():
    fn, args = _dense_problem(fresh_seed())
    with pytest.raises(ValueError, match="custom call"):
        export.export(jax.jit(fn))(*args)


def test_target_names_carry_the_release():
    fn, args = _dense_problem(fresh_seed())
    module = export.export(jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)))),
                           disabled_checks=jfa.export_disabled_checks())(*args).mlir_module()
    suffix = "_v" + jfa.__version__.replace(".", "_")
    for target in (_ext.FORWARD_TARGET, _ext.BACKWARD_TARGET, _ext.PACK_MASK_TARGET):
        assert target.endswith(suffix) and f"@{target}(" in module
    assert len(jfa.export_disabled_checks()) == 6


def test_other_platforms_export_where_their_kernels_are_built():
    fn, args = _dense_problem(fresh_seed())
    checks = jfa.export_disabled_checks()
    if not jfa.build_info()["cuda"]:
        with pytest.raises(RuntimeError, match="without its CUDA kernels"):
            export.export(jax.jit(fn), platforms=("cpu", "cuda"), disabled_checks=checks)(*args)
        return
    exported = export.export(jax.jit(fn), platforms=("cpu", "cuda"), disabled_checks=checks)(*args)
    restored = export.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "cuda")
    with jax.default_device(jax.devices("cpu")[0]):
        np.testing.assert_array_equal(np.asarray(restored.call(*args)), np.asarray(jax.jit(fn)(*args)))


def _run_elsewhere(tmp_path, blob, args, import_library):
    """Deserializes and calls the program in a fresh Python process, as a server would."""
    (tmp_path / "program.bin").write_bytes(blob)
    np.savez(tmp_path / "args.npz", *[np.asarray(x) for x in args])
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from jax import export
        {"import jax_flashattn" if import_library else ""}
        jax.config.update("jax_platforms", "cpu")
        program = export.deserialize(open({str(tmp_path / "program.bin")!r}, "rb").read())
        args = np.load({str(tmp_path / "args.npz")!r})
        out = program.call(*[args[f"arr_{{i}}"] for i in range(len(args.files))])
        np.save({str(tmp_path / "out.npy")!r}, np.asarray(out))
    """)
    tests_dir = pathlib.Path(__file__).resolve().parent
    return subprocess.run([sys.executable, "-c", script], cwd=tests_dir.parent, capture_output=True,
                          text=True, timeout=300)


def test_a_fresh_process_runs_the_program_only_with_the_library(tmp_path):
    fn, args = _dense_problem(fresh_seed())
    blob = export.export(jax.jit(fn), disabled_checks=jfa.export_disabled_checks())(*args).serialize()

    without = _run_elsewhere(tmp_path, blob, args, import_library=False)
    release = "_v" + jfa.__version__.replace(".", "_")
    assert without.returncode != 0, "the program ran without jax_flashattn's handlers"
    assert re.search(rf"jfa_\w+{release}", without.stderr), without.stderr[-2000:]

    with_library = _run_elsewhere(tmp_path, blob, args, import_library=True)
    assert with_library.returncode == 0, with_library.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.asarray(jax.jit(fn)(*args)))
