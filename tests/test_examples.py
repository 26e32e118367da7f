"""The example scripts run end to end with tiny settings and print their summary table.

Each script runs as a subprocess exactly as a user would start it. DenseNet-121 and InceptionV3 take over a minute
each on 2 cores (most of it tracing the step and the Dymem pass), so they are marked slow.
"""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
TABLE_HEADER = ("model", "policy", "batch", "status", "device peak MiB", "reserved MiB", "host peak MiB")


def run_example(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def assert_summary_table(proc: subprocess.CompletedProcess, model: str, policy: str = "dymem") -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    header = next((line for line in lines if all(h in line for h in TABLE_HEADER)), None)
    assert header is not None, proc.stdout[-2000:]
    rows = [line.split() for line in lines if line.startswith(model + " ")]
    assert rows, proc.stdout[-2000:]
    row = rows[-1]
    assert row[1] == policy and row[3] == "ok", row
    assert float(row[4]) > 0  # device peak MiB, measured by GTBM


TINY = {
    "vgg16": ("train_vgg16.py", "32"),
    "resnet50": ("train_resnet50.py", "32"),
    "densenet121": pytest.param("train_densenet121.py", "32", marks=pytest.mark.slow),
    "inception_v3": pytest.param("train_inception_v3.py", "75", marks=pytest.mark.slow),  # 75 is its minimum
}


@pytest.mark.parametrize("script,image_size", list(TINY.values()), ids=list(TINY))
def test_training_example_runs_and_prints_the_table(script, image_size):
    model = script[len("train_"):-len(".py")]
    proc = run_example(script, "--batch", "2", "--image-size", image_size, "--steps", "2", "--quiet")
    assert_summary_table(proc, model)


def test_example_rejects_bad_flags():
    proc = run_example("train_resnet50.py", "--batch", "0", timeout=120)
    assert proc.returncode == 2
    assert "--batch must be positive" in proc.stderr


def test_find_max_batch_tiny():
    # One trial: batch 1 fits under 512 MiB, and the limit stops the doubling there.
    proc = run_example("find_max_batch.py", "--model", "resnet50", "--image-size", "32", "--budget", "512MiB",
                       "--policies", "none", "--steps", "1", "--start", "1", "--limit", "1")
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "none   batch     1: fits" in proc.stdout
    assert "largest batch under 512MiB (resnet50, 32x32):" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].split() == ["none", "1"]
