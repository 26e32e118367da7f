"""XLA and a train step that swaps: an XLA cluster would swallow the swap ops, so the step is built without XLA while
Dymem plans it (and given back to XLA when the plan swaps nothing), or auto-clustered around the swap ops
(``DymemCallback(xla="auto")``)."""
from __future__ import annotations

import contextlib

from dymem_tf import compat
from dymem_tf.memory import devices


def turn_off(model, mode, say, warn) -> list[str]:
    """Build the train function without XLA and return which XLA settings the user asked for (they come back when
    the plan swaps nothing, see :func:`restore`); ``mode`` is the callback's ``xla``; ``say`` prints, ``warn``
    warns (when XLA cannot be turned off)."""
    asked = []
    if make_train_function_without_xla(model):
        asked.append("jit_compile=True")
    if mode == "auto":
        say_auto_clustering(asked, say, warn)
        return []  # the step stays auto-clustered whatever its plan
    if compat.autoclustering_requested():
        asked.append("auto-clustering (tf.config.optimizer.set_jit)")
    forced = compat.forced_auto_jit_flag()
    if forced is not None:
        warn(f"dymem_tf: TF_XLA_FLAGS=--tf_xla_auto_jit={forced} compiles the train step into XLA clusters "
             "before Dymem's pass sees it, and overrides any per-function setting: no feature map can be "
             "swapped in this run. Unset --tf_xla_auto_jit to train with Dymem.")
    if asked:
        say(f"dymem_tf: XLA ({', '.join(asked)}) is off for the train step while Dymem plans it, and stays "
            "off if the plan swaps: an XLA cluster would swallow the swap ops. A plan that swaps nothing "
            "gives the step back to XLA.")
    return asked


def say_auto_clustering(asked: list[str], say, warn) -> None:
    """``xla="auto"``: say how the step runs, and warn when XLA cannot cluster it on this machine."""
    if asked:
        say("dymem_tf: jit_compile=True would compile the whole train step as one XLA cluster, which "
            "would swallow the swap ops: with xla='auto' the step is auto-clustered around them instead.")
    if not devices.training_gpus() and not compat.cpu_autoclustering_enabled():
        warn("dymem_tf: xla='auto' on the CPU: XLA clusters CPU ops only with "
             "TF_XLA_FLAGS=--tf_xla_cpu_global_jit set before TensorFlow starts; without it the step runs "
             "unclustered.")


def step_clustering(mode):
    """The XLA auto-clustering the train step's calls run under: on around the swap ops with ``mode="auto"``,
    explicitly off where the user turned it on for every function (it would swallow the swap ops), else as
    TF's configuration says."""
    if mode == "auto":
        return compat.autoclustering_on()
    return compat.autoclustering_off() if compat.autoclustering_requested() else contextlib.nullcontext()


def restore(model, asked: list[str], say) -> None:
    """The plan of the train function's first step swaps nothing: from the next step on, run the train step as
    the user compiled it (with XLA, ``asked``), without the pass."""
    model.make_train_function(force=True)  # the model's own jit_compile; auto-clustering as the user set it
    say(f"dymem_tf: the plan swaps nothing, so the train step runs with XLA ({', '.join(asked)}) "
        "as you set it, from its next step on (its first step ran without XLA).")


def make_train_function_without_xla(model) -> bool:
    """Build ``model.train_function`` afresh without XLA; return whether the model asked for XLA.

    Keras reads ``model.jit_compile`` when it builds a function (``tf.function(..., jit_compile=...)``), so the flag
    is off only while the train function is built: the model keeps the user's value, and its evaluate and predict
    functions (traced during ``fit`` for validation, or after it) keep XLA.
    """
    if not getattr(model, "jit_compile", False):
        model.make_train_function(force=True)
        return False
    compat.build_without_jit(model, lambda: model.make_train_function(force=True))
    return True
