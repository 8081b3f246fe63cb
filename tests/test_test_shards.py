"""The suite's own sharding (JFA_TEST_SHARD=i/N, tests/conftest.py), which the GPU machine's runs
rely on to cover every test across time-limited calls: the shards of a selection are disjoint and
together are the selection, -k applies before the cut, and a bad value is refused."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from util import child_pytest_env

HERE = pathlib.Path(__file__).resolve().parent

SAMPLE = '''
import pytest

@pytest.mark.parametrize("i", range(11))
def test_even(i):
    assert i % 2 == 0 or i > 100

@pytest.mark.parametrize("i", range(4))
def test_other(i):
    pass
'''


def _run(folder, shard, *args, workers=0):
    env = child_pytest_env(JFA_TEST_SHARD=shard, JFA_REPORT_FAILURES="1")
    parallel = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *parallel, "-rA", "-q", *args,
                           str(folder)], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def _outcomes(run):
    """test id -> PASSED/FAILED from -rA's summary lines."""
    return dict((m.group(2), m.group(1)) for m in re.finditer(r"^(PASSED|FAILED) (\S+)", run.stdout, re.M))


@pytest.fixture()
def sample(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    return tmp_path


def test_shards_partition_the_selection(sample):
    for count, args in ((3, ()), (4, ("-k", "not other"))):
        seen = {}
        for index in range(1, count + 1):
            got = _outcomes(_run(sample, f"{index}/{count}", *args))
            assert got, f"shard {index}/{count} ran nothing"
            assert not set(got) & set(seen), f"shard {index}/{count} repeats {set(got) & set(seen)}"
            seen.update(got)
        everything = _outcomes(_run(sample, "1/1", *args))
        assert seen == everything
        assert len(everything) == (11 if args else 15)


def test_failures_are_named_as_they_happen(sample):
    run = _run(sample, "1/1")
    assert "FAILED test_sample.py::test_even[1] (call)" in run.stderr


def test_under_xdist_workers_agree_and_failures_print_once(sample):
    pytest.importorskip("xdist")
    run = _run(sample, "2/3", workers=2)
    assert _outcomes(run) == _outcomes(_run(sample, "2/3")), run.stdout[-3000:]
    # Shard 2 of 3 holds test_even[1]: the one failure, printed by the controller alone.
    assert run.stderr.count("FAILED test_sample.py::test_even[1] (call)") == 1, run.stderr[-3000:]


@pytest.mark.parametrize("value", ["0/3", "4/3", "2", "a/b"])
@pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])
def test_bad_shard_is_refused(sample, value, workers):
    if workers:
        pytest.importorskip("xdist")
    run = _run(sample, value, workers=workers)
    assert run.returncode != 0 and "JFA_TEST_SHARD must be i/N" in run.stdout + run.stderr
