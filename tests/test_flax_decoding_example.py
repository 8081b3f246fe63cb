"""examples/flax_decoding.py: the cached decode gives the logits of the model run without a cache,
its step compiles once, and its cache is donated (updated in place)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from util import rel_err

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "flax_decoding.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("flax_decoding", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(scope="module")
def model():
    return example.Decoder(example.Config(), nnx.Rngs(0))


def test_cached_decode_matches_full_recomputation(model):
    prompts, prompt_lengths = example.byte_prompts(2)
    assert prompt_lengths[0] != prompt_lengths[1], "the batch should mix prompt lengths"
    generated, logits = example.generate(model, prompts, prompt_lengths, steps=6)
    want = example.full_sequence_logits(model, prompts, prompt_lengths, generated)
    assert generated.shape == (2, 6) and logits.shape == want.shape == (2, 6, 256)
    for b in range(2):
        for step in range(6):
            error = rel_err(logits[b, step], want[b, step])
            assert error < 1e-5, f"sequence {b}, step {step}: relative error {error:.2e}"
    assert np.array_equal(generated, jnp.argmax(want, axis=-1))


def test_decode_step_traces_once(model, monkeypatch):
    traces = []
    decode = example.Decoder.decode

    def counted_decode(self, tokens, cache):
        traces.append(tokens.shape)
        return decode(self, tokens, cache)

    monkeypatch.setattr(example.Decoder, "decode", counted_decode)
    example.decode_step.clear_cache()  # a step compiled by another test would hide the first trace
    prompts, prompt_lengths = example.byte_prompts(2)
    example.generate(model, prompts, prompt_lengths, steps=5)
    assert len(traces) == 1, f"decode_step traced {len(traces)} times for 4 steps"


def test_decode_step_donates_the_cache(model):
    graphdef, params = nnx.split(model)
    cache = example.empty_cache(model.config, 2)
    tokens = jnp.array([65, 66], jnp.int32)
    compiled = example.decode_step.lower(graphdef, params, cache, tokens).compile()
    # Every cache leaf is an input the compiled step may write its output into: the parameters come
    # first in the flattened arguments, then the cache.
    first = len(jax.tree.leaves(params))
    cache_inputs = set(range(first, first + len(jax.tree.leaves(cache))))
    header = compiled.as_text().splitlines()[0]
    aliased = {int(i) for i in re.findall(r": \((\d+), \{\}, (?:may|must)-alias\)", header)}
    assert aliased == cache_inputs, header[:400]
    cache_shape = "f32[{}]".format(",".join(map(str, cache.keys[0].shape)))
    copies = [line for line in compiled.as_text().splitlines() if f"= {cache_shape}" in line and " copy(" in line]
    assert not copies, f"the step copies the cache: {copies}"

    _, new_cache = example.decode_step(graphdef, params, cache, tokens)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache)), "the old cache is still alive"
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))
    np.testing.assert_array_equal(new_cache.lengths, [1, 1])


def test_main_runs_and_checks(capsys):
    example.main(["--steps", "6", "--batch", "2"])
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "max |difference|" in printed
