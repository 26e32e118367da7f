"""``python -m dymem_tf selfcheck`` on the CPU (issue #12, item 5): the report and the exit status."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def selfcheck(*args, inject: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("DYMEM_SELFCHECK_INJECT", None)
    if inject is not None:
        env["DYMEM_SELFCHECK_INJECT"] = inject
    return subprocess.run([sys.executable, "-m", "dymem_tf", "selfcheck", *args], env=env, capture_output=True,
                          text=True, timeout=240, cwd=REPO)


def rows(stdout: str) -> dict[tuple[str, str], str]:
    """(check, device) -> result, from the report's table."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith(" "):  # a wrapped detail
            continue
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("gtbm", "kernels", "bandwidth", "training"):
            found[(parts[0], parts[1])] = parts[2]
        elif len(parts) >= 4 and parts[:2] == ["round", "trip"]:
            found[("round trip", parts[2])] = parts[3]
    return found


def test_selfcheck_passes_on_the_cpu_and_says_what_it_did_not_run():
    proc = selfcheck()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table, text = rows(proc.stdout), " ".join(proc.stdout.split())  # the detail column wraps
    assert table == {("gtbm", "CPU:0"): "ok", ("gtbm", "GPU"): "info", ("kernels", "CPU"): "ok",
                     ("kernels", "GPU"): "info",
                     ("round trip", "CPU:0"): "ok", ("bandwidth", "CPU:0"): "skipped", ("training", "CPU:0"): "ok"}
    assert "get_memory_info('CPU:0') agrees" in text
    assert "GTBM serves GPU:0: no (opt-in DYMEM_GTBM_GPU=1: not set; no GPU is visible)" in text
    assert "bit-exact for 15 dtypes" in text and "int32" in text and "bfloat16" in text
    assert "losses and weights identical to training without swapping" in text
    assert "0 failed" in text and "No GPU is visible" in text


def test_a_failed_check_gives_a_non_zero_exit():
    """The test hook corrupts one byte of a round trip and one loss of the swapped training: both checks' own
    comparisons catch it, and the exit status is 1."""
    proc = selfcheck(inject="round trip,training")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    table, text = rows(proc.stdout), " ".join(proc.stdout.split())
    assert table[("round trip", "CPU:0")] == "FAIL" and table[("training", "CPU:0")] == "FAIL"
    assert "different after the round trip: float16[1031, 3]" in text
    assert table[("gtbm", "CPU:0")] == "ok" and "2 failed" in text
