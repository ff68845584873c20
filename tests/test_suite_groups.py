"""The suite's own hand-out under pytest-xdist (``make test-fast``: ``-n 2 --dist loadgroup``): the tests marked
``full_width`` run on one worker, one after another (two full-width models at once would pass CI's 24 GiB). Under
pytest 9.2 pytest-xdist 3.8 silently ignored every group (pytest-dev/pytest-xdist#1386), and tests/conftest.py's
hook ran after xdist's: both together let them run side by side unnoticed."""

import json
import os
import shutil
import subprocess
import sys

from conftest import REPO

TESTS = '''
import json, os, time
import pytest

@pytest.mark.full_width
@pytest.mark.parametrize("i", range(4))
def test_wide(i):
    time.sleep(0.3)
    print(json.dumps(["wide", os.environ["PYTEST_XDIST_WORKER"]]), file=open("ran.jsonl", "a"))

@pytest.mark.parametrize("i", range(4))
def test_narrow(i):
    time.sleep(0.3)
    print(json.dumps(["narrow", os.environ["PYTEST_XDIST_WORKER"]]), file=open("ran.jsonl", "a"))
'''


def test_full_width_tests_go_to_one_worker(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_groups.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    full_width: one worker\n    vllm: last\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                             "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stdout[-2000:]
    ran = [json.loads(line) for line in (tmp_path / "ran.jsonl").read_text().splitlines()]
    workers = {kind: {worker for k, worker in ran if k == kind} for kind in ("wide", "narrow")}
    assert len(ran) == 8 and len(workers["wide"]) == 1, ran
    assert workers["narrow"] - workers["wide"], ran  # the other worker ran the rest meanwhile
