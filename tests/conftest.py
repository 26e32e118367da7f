"""Shared test set-up: dymem_tf is imported first so the GTBM allocator is registered before TF allocates."""
import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import dymem_tf  # noqa: E402,F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tf_functions(fn, depth=0, seen=None) -> list:
    """The ``tf.function`` objects a Keras train/test/predict function calls (through closures and wrappers)."""
    seen = set() if seen is None else seen
    if fn is None or id(fn) in seen or depth > 8:
        return []
    seen.add(id(fn))
    fn = getattr(fn, "__wrapped__", fn)
    found = [fn] if hasattr(fn, "_jit_compile") and hasattr(fn, "get_concrete_function") else []
    fn = getattr(fn, "_python_function", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value):
            found += tf_functions(value, depth + 1, seen)
    return found


def xla(fn) -> set:
    """The ``jit_compile`` settings of the per-step ``tf.function`` under a Keras function."""
    return {f._jit_compile for f in tf_functions(fn) if f.__name__ == "one_step_on_data"}  # noqa: SLF001


def run_python(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (for allocator set-ups that must happen before TF starts)."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def script_result(returncode: int, stdout: str, stderr: str, name: str = "the script") -> dict:
    """The JSON a test script printed on its last ``RESULT`` line, after asserting that it exited cleanly and
    printed one (the tails of its output in the failure message)."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT")]
    assert returncode == 0 and lines, f"{name} failed (rc={returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT"):])


def proc_result(proc: subprocess.CompletedProcess, name: str = "the script") -> dict:
    """:func:`script_result` of a finished ``subprocess.run``."""
    return script_result(proc.returncode, proc.stdout, proc.stderr, name)


#: Modules whose plain Keras fits (without the callback) leave device memory held after the module, past
#: ``keras.backend.clear_session()`` and ``gc.collect()``: TF keeps the train step's graph, with the variables it
#: captured, alive (VGG16 32px + SGD: 256 MiB; tests/test_models.py: 844 MiB, measured with DYMEM_TEST_MEMLOG). A
#: fit with DymemCallback releases them. They run last, so that the in-process tests under a 64 MiB budget
#: (test_reliability, test_session) find the device empty.
HOLD_DEVICE_MEMORY = ("test_models.py",)


def pytest_collection_modifyitems(config, items):
    """Run the modules of :data:`HOLD_DEVICE_MEMORY` after all others (stable: the order is otherwise kept)."""
    items.sort(key=lambda item: item.path.name in HOLD_DEVICE_MEMORY)


@pytest.fixture(scope="module", autouse=True)
def _release_device_memory_after_module(request):
    """After each test module: Keras's global state cleared and garbage collected, so the models and tensors the
    module built stop holding the in-process device. Tests that cap that device at a small budget (64 MiB) count
    every byte on it: the full suite's earlier modules left ~64 MiB there, and tiny models ran out of memory. With
    ``DYMEM_TEST_MEMLOG=path`` each module's device bytes in use after the release are appended to that file."""
    yield
    import gc

    import keras

    from dymem_tf.memory import allocator

    def in_use():
        return allocator.memory_stats().get("bytes_in_use", -1) if allocator.is_active() else -1

    before = in_use()
    keras.backend.clear_session()
    gc.collect()
    log = os.environ.get("DYMEM_TEST_MEMLOG")
    if log:
        with open(log, "a") as fh:
            fh.write(f"{request.module.__name__} {before} {in_use()}\n")


@pytest.fixture
def python_subprocess():
    return run_python


@pytest.fixture
def deterministic():
    """Op determinism on for the test (restored after): bit-identity checks."""
    from tensorflow.python.framework import config as tf_config

    was_on = tf_config.is_op_determinism_enabled()
    tf_config.enable_op_determinism()
    yield
    if not was_on:
        tf_config.disable_op_determinism()


def unknown_width_model():
    """A model whose backward pass keeps a tensor whose width only the step knows (a boolean mask): planned around
    without a budget, left unmodified under one."""
    import keras

    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 8))
    h = keras.layers.Dense(16)(keras.layers.Flatten()(inp))
    kept = keras.layers.Lambda(lambda t: tf.boolean_mask(t, tf.math.is_finite(t[0]), axis=1))(h)
    energy = keras.layers.Lambda(lambda t: tf.reduce_sum(tf.square(t), axis=1, keepdims=True))(kept)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.Concatenate()([h, energy])))
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
