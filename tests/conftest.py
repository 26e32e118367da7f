"""Shared test set-up: dymem_tf is imported first so the GTBM allocator is registered before TF allocates."""
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import dymem_tf  # noqa: E402,F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (for allocator set-ups that must happen before TF starts)."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture
def python_subprocess():
    return run_python
