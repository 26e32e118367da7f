"""pytest plugin: every ``TensorFlowTrainer.fit`` gets
``DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)`` appended.

Enable it with ``-p tools.keras_conformance.inject_dymem`` (from the repository root). It imports ``dymem_tf`` right
after TensorFlow (before any test allocates, so that the GTBM allocator serves the device as it would for a user),
wraps ``keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit`` and, when ``--dymem-record=PATH`` is given,
appends one JSON line per injected ``fit`` to ``PATH``:

``{"test": test id, "swapped": bool, "traces": n, "swaps": n, "skipped": [kind, ...], "skipped_reasons": [text,
...], "eager": bool, "raised": exception type or null}``

``swapped`` is true when the callback's last plan (``callback.plan``) has swaps; ``skipped`` lists the ``kind`` of
every trace the pass left unmodified (``callback.skipped``).
"""
from __future__ import annotations

import functools
import inspect
import json
import os

import pytest

from tools.keras_conformance import outcomes

_STATE = {"test": None, "record": None}


def pytest_addoption(parser):
    parser.addoption("--dymem-record", default=None,
                     help="append one JSON line per fit with the injected DymemCallback to this file")


def pytest_configure(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow  # noqa: F401  (dymem_tf must come right after it, before any tensor exists)

    import dymem_tf  # noqa: F401

    _STATE["record"] = config.getoption("--dymem-record")
    if _STATE["record"]:
        with open(_STATE["record"], "a", encoding="utf-8") as f:
            f.write(json.dumps({"dymem_tf": os.path.dirname(os.path.abspath(dymem_tf.__file__))}) + "\n")
    install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _STATE["test"] = outcomes.test_id(item)
    try:
        yield
    finally:
        _STATE["test"] = None


def install() -> None:
    """Wrap ``TensorFlowTrainer.fit`` (idempotent)."""
    from keras.src.backend.tensorflow import trainer

    fit = trainer.TensorFlowTrainer.fit
    if getattr(fit, "_dymem_injected", False):
        return
    signature = inspect.signature(fit)

    @functools.wraps(fit)
    def fit_with_dymem(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        model = bound.arguments["self"]
        callback = _new_callback()
        bound.arguments["callbacks"] = _with_callback(bound.arguments.get("callbacks"), callback, model)
        raised = None
        try:
            return fit(*bound.args, **bound.kwargs)
        except BaseException as err:
            raised = type(err).__name__
            raise
        finally:
            _record(callback, model, raised)

    fit_with_dymem._dymem_injected = True  # pylint: disable=protected-access
    trainer.TensorFlowTrainer.fit = fit_with_dymem


def _new_callback():
    import dymem_tf

    return dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)


def _with_callback(callbacks, callback, model):
    """``callbacks`` (None, a callback, a list or tuple, or a ``CallbackList``) with ``callback`` appended."""
    from keras.src.callbacks.callback_list import CallbackList

    if isinstance(callbacks, CallbackList):
        # fit uses a CallbackList as it is: add the callback the way the list's constructor would have
        callbacks.callbacks.append(callback)
        if callbacks.params:
            callback.set_params(callbacks.params)
        callback.set_model(callbacks.model if getattr(callbacks, "model", None) is not None else model)
        return callbacks
    if callbacks is None:
        return [callback]
    if isinstance(callbacks, (list, tuple)):
        return list(callbacks) + [callback]
    return [callbacks, callback]


def _record(callback, model, raised) -> None:
    path = _STATE["record"]
    if not path:
        return
    plan = callback.plan
    row = {
        "test": _STATE["test"],
        "swapped": bool(plan is not None and plan.swaps),
        "traces": len(callback.records),
        "swaps": len(plan.swaps) if plan is not None else 0,
        "skipped": [s.kind for s in callback.skipped],
        "skipped_reasons": sorted({s.reason for s in callback.skipped}),
        "eager": bool(getattr(model, "run_eagerly", False)),
        "raised": raised,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
