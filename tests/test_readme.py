"""README's Python examples run as written, in order, in one namespace (later blocks use earlier
names), on whatever backend is present: the examples are the documentation of every keyword."""
from __future__ import annotations

import pathlib
import re

import jax
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_examples():
    blocks = _python_blocks()
    assert len(blocks) >= 4, "README's Python examples went missing"
    text = "".join(blocks)
    for keyword in ["bias=", "mask=", "query_seq_lengths=", "key_value_seq_lengths=", "local_window_size=",
                    "causal_alignment=", "q_segment_ids=", "kv_segment_ids=", "softcap=", "alibi_slopes=",
                    "dropout_rate=", "dropout_rng=", "deterministic=", "varlen_attention(",
                    "dot_product_attention("]:
        assert keyword in text, f"README has no example of {keyword}"


def test_readme_examples_run():
    pytest.importorskip("flax")
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    namespace: dict = {}
    for i, block in enumerate(_python_blocks()):
        # jax.nn's cuDNN implementation, which the drop-in passes through to, needs a GPU.
        lines = [line for line in block.splitlines() if on_gpu or 'implementation="cudnn"' not in line]
        code = compile("\n".join(lines), f"README.md python block {i}", "exec")
        exec(code, namespace)  # noqa: S102 (the repository's own README)
    assert namespace["out"].shape[0] == 356   # the last block: a packed varlen output
