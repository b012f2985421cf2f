"""Kernel builds that survive interruption (target/build.py): a build killed midway leaves torch's
lock file behind, and the next run must build and finish instead of waiting on it forever; two runs
that build at once share
one build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A C++ file the compiler takes a few seconds over (it evaluates a loop at compile time), so that a
# test can kill its build midway; no torch headers, so the build itself stays cheap.
SOURCE = """
constexpr long spin(long n) { long s = 0; for (long i = 0; i < n; ++i) s += i % 7; return s; }
extern "C" long headway_test_value() { constexpr long v = spin(SPIN); return v; }
"""
FLAGS = [
    "-O0",
    "-DSPIN=1500000",
    "-fconstexpr-loop-limit=100000000",
    "-fconstexpr-ops-limit=10000000000",
]
NAME = "headway_build_test"


def _build(tmp_path: Path) -> subprocess.Popen:
    """A process that builds the test extension under Headway's lock, as the kernels' first use
    does."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from headway.target.build import load_extension\n"
        f"print('built', load_extension({NAME!r}, [{str(tmp_path / 'slow.cpp')!r}], {FLAGS!r}, "
        "is_python_module=False), flush=True)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the kill takes the compiler with it
    )


def _build_dir(tmp_path: Path) -> Path:
    found = list((tmp_path / "ext").glob(f"*/{NAME}")) + list((tmp_path / "ext").glob(NAME))
    return found[0] if found else tmp_path / "ext" / "missing"


def _wait_for_torch_lock(tmp_path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> Path:
    """torch's lock file once the build has started compiling (polling: the build runs in another
    process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lock = _build_dir(tmp_path) / "lock"
        if lock.exists():
            return lock
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    pytest.fail("the build never started")


@pytest.fixture
def source(tmp_path):
    if subprocess.run(["which", "g++"], capture_output=True).returncode:
        pytest.skip("no C++ compiler")
    (tmp_path / "slow.cpp").write_text(SOURCE)
    return tmp_path


def test_a_build_killed_midway_then_the_next_run_builds_and_finishes(source):
    tmp_path = source
    first = _build(tmp_path)
    lock = _wait_for_torch_lock(tmp_path, first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert lock.exists()  # what made every later build wait forever before

    second = _build(tmp_path)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert f"removing {lock}, left by an interrupted build of {NAME}" in out
    assert "built " in out and not lock.exists()


def test_two_processes_building_at_once_share_one_build(source):
    tmp_path = source
    first = _build(tmp_path)
    _wait_for_torch_lock(tmp_path, first)
    second = _build(tmp_path)
    outs = [p.communicate(timeout=300)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    # the compiler ran once: ninja logs each compile it runs, and the second process found the
    # object up to date
    log = (_build_dir(tmp_path) / ".ninja_log").read_text().splitlines()
    assert [line.split("\t")[3] for line in log[1:]].count("slow.o") == 1, log


def test_a_build_is_announced_only_where_it_compiles(tmp_path: Path, monkeypatch, caplog):
    """The "building ... (once)" line is logged where the library has to be compiled, not on every
    run that only loads it; a source newer than the library is compiled, and said, again."""
    import logging

    from headway.target.build import load_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "quick.cpp"
    source.write_text(SOURCE)
    flags = [f for f in FLAGS if not f.startswith("-DSPIN")] + ["-DSPIN=10"]

    def announced() -> bool:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="headway"):
            load_extension(
                "headway_announce_test",
                [str(source)],
                flags,
                announce="compiling it",
                is_python_module=False,
            )
        return "compiling it" in caplog.messages

    assert announced()
    assert not announced()
    later = time.time() + 5
    os.utime(source, (later, later))
    assert announced()
