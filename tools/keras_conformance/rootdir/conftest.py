"""The ``conftest`` Keras's test modules expect at the root of a Keras checkout (the wheel does not ship one).

Some modules import ``skip_if_backend`` from it; it also declares the markers Keras's tests use and skips the
``multi_device`` tests, which need more than one device of the JAX or torch backend. The runner starts pytest in
this folder, so that no conftest of dymem_tf's own tests is loaded into Keras's run.
"""
import pytest


def _backend() -> str:
    from keras.src.backend import backend

    return backend()


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: needs a backend that can train")
    config.addinivalue_line("markers", "multi_device: needs several devices")
    if _backend() == "tensorflow":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            # full float32 matmuls on a GPU, as Keras's correctness tests assume
            tf.config.experimental.enable_tensor_float_32_execution(False)


def pytest_collection_modifyitems(config, items):
    cannot_train = pytest.mark.skipif(_backend() in ("numpy", "openvino"), reason="this backend has no trainer")
    one_device = pytest.mark.skip(reason="needs several devices (JAX or torch backend)")
    for item in items:
        if "requires_trainable_backend" in item.keywords:
            item.add_marker(cannot_train)
        if "multi_device" in item.keywords:
            item.add_marker(one_device)


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(_backend() == given_backend, reason=reason)
