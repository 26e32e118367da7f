"""The standalone C++ test of the GTBM core (dymem_tf/cc/gtbm/tests/gtbm_core_test.cc), plain and under ASan+UBSan.

The binaries are built with g++ directly (the commands of ``make native-test`` / ``make asan``) into ``build/`` and
reused while they are newer than the sources, so only the first run pays for the compilation (the sanitizer build
takes 20-45 s on 2 busy cores).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = "dymem_tf/cc/gtbm"
# The core without the replay engine, then the test: what `make native-test` compiles (its CORE_SRC, CORE_TEST).
SOURCES = ([f for f in sorted(glob.glob(f"{CORE}/*.cc", root_dir=REPO)) if not f.endswith("/replay.cc")]
           + [f"{CORE}/tests/gtbm_core_test.cc"])
DEPS = SOURCES + sorted(glob.glob(f"{CORE}/*.h", root_dir=REPO))
CXX = os.environ.get("CXX", "g++")

pytestmark = pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} not found")


def _build(name: str, flags: list[str]) -> str:
    out = os.path.join(REPO, "build", name)
    newest = max(os.path.getmtime(os.path.join(REPO, f)) for f in DEPS)
    if not os.path.exists(out) or os.path.getmtime(out) < newest:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = [CXX, "-std=c++17", *flags, "-pthread", *SOURCES, "-o", out]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"build failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}"
    return out


def _run(binary: str, args: list[str], env: dict | None = None, timeout: int = 300) -> str:
    trace = os.path.join(REPO, "build", os.path.basename(binary) + "_trace.csv")
    proc = subprocess.run([binary, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, GTBM_TEST_TRACE=trace, **(env or {})))
    assert proc.returncode == 0, f"{binary} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.strip().endswith("OK")
    return proc.stdout


def test_core_randomised_and_threaded():
    """Randomised alloc/free sequences (40 seeds x 4 policies) against a reference model, and 4 threads x 150k
    operations with a granule-ownership overlap detector."""
    binary = _build("gtbm_core_test", ["-O2", "-Wall", "-Wextra", "-Werror"])
    out = _run(binary, ["--seeds", "40", "--ops", "3000", "--threads", "4", "--thread-ops", "150000"])
    assert "4 threads x 150000 ops" in out


def test_core_under_address_and_undefined_sanitizers():
    """The same test built with -fsanitize=address,undefined (leak detection on), smaller but still threaded."""
    binary = _build("gtbm_core_test_asan",
                    ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                     "-fno-sanitize-recover=all"])
    _run(binary, ["--seeds", "12", "--ops", "2000", "--threads", "4", "--thread-ops", "60000"],
         env={"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"})
