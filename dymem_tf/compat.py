"""Every TensorFlow and Keras internal that dymem_tf relies on, in one place, behind one version gate.

dymem_tf is built and tested against TensorFlow 2.21 and Keras 3.10–3.x. The hooks below are not public API in
either; a new release may move them. :func:`check_versions` names the supported versions in a clear error instead
of letting a missing attribute surface deep inside ``fit``. Nothing here imports TensorFlow or Keras at module
level.

| hook | why |
| --- | --- |
| ``tensorflow.python.eager.context`` | whether TF's runtime (and so its CPU allocator) exists yet |
| ``tensorflow.python.util._pywrap_util_port.IsMklEnabled`` | whether oneDNN kernels run (they crash on OOM) |
| ``TFE_ContextListDevices`` / ``TF_DeviceListMemoryBytes`` (TF's C API, through ctypes) | a GPU's memory limit as TF computed it, read from the eager context's own devices |
| ``TFE_ContextStartStep`` / ``TFE_ContextEndStep`` (TF's C API, through ctypes); the other threads' frames (``sys._current_frames``) | empty the step container a failed call left, while no other thread is inside TF's execution |
| ``tensorflow.python.eager.context`` function call options | autoclustering off for the rewritten train step only |
| ``tensorflow.python.framework.kernels`` | which devices the swap ops have kernels for (``selfcheck``); which outputs a GPU kernel keeps in host memory (``HostMemory``) |
| ``tensorflow.python.framework.op_def_registry`` | an op's output argument names, to map ``HostMemory`` names to output indices; which standard op a oneDNN op replaces |
| ``tensorflow.python.data.util.structure.normalize_element`` | the one place tf.data turns inputs into tensors |
| ``keras.src.callbacks.callback_list.CallbackList`` | the list whose hook is calling a callback |
| the ``fit`` frame's locals (``epoch_iterator``, ``batch_size``) | the batch size of the running ``fit`` |
| ``Model._jit_compile`` | put the user's XLA flag back without the setter's re-check |
| ``GeneratorDataAdapter._first_batches`` | the batch size of a generator's first batches |
| ``Layer._flatten_layers`` | whether every layer is built (the optimizer may be built early) |
| ``tf.data`` datasets' ``_batch_size`` / ``_input_dataset`` | the static batch size of a pipeline |
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import sys
import threading
import warnings

logger = logging.getLogger("dymem_tf")

#: TensorFlow versions (major.minor) the native libraries and the hooks are built for.
SUPPORTED_TENSORFLOW = ("2.21",)
#: Keras versions: from 3.10 up to, not including, 4.
SUPPORTED_KERAS = ((3, 10), (4, 0))


class UnsupportedVersionError(ImportError):
    """TensorFlow or Keras is a version whose internals dymem_tf was not built against."""


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split(".") + ["0", "0"])[:2]
    return int("".join(c for c in parts[0] if c.isdigit()) or 0), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def version_problem(tf_version: str, keras_version: str) -> str | None:
    """Why these versions are unsupported, or None when they are supported."""
    tf_mm = ".".join(map(str, _major_minor(tf_version)))
    if tf_mm not in SUPPORTED_TENSORFLOW:
        return (f"TensorFlow {tf_version} is not supported: dymem_tf works with TensorFlow "
                f"{' or '.join(v + '.x' for v in SUPPORTED_TENSORFLOW)}")
    low, high = SUPPORTED_KERAS
    if not low <= _major_minor(keras_version) < high:
        return (f"Keras {keras_version} is not supported: dymem_tf works with Keras >= {low[0]}.{low[1]}, "
                f"< {high[0]}.{high[1]}")
    return None


@functools.lru_cache(maxsize=1)
def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` unless the running TensorFlow and Keras are supported."""
    import keras
    import tensorflow as tf

    problem = version_problem(tf.__version__, keras.__version__)
    if problem:
        raise UnsupportedVersionError(problem + " (install a supported version, or a dymem_tf release built for "
                                                "yours).")


# ------------------------------------------------------------------------------------------------- TensorFlow

def eager_context_initialized() -> bool:
    """True once TF's eager context exists, i.e. once TF may have created its CPU allocator."""
    from tensorflow.python.eager import context

    ctx = context.context_safe()
    return ctx is not None and ctx._context_handle is not None  # pylint: disable=protected-access


def ensure_eager_context() -> None:
    """Initialise TF's runtime (which creates the CPU allocator) if it is not yet."""
    from tensorflow.python.eager import context

    context.ensure_initialized()


def onednn_enabled() -> bool | None:
    """Whether TF runs its oneDNN (MKL) CPU kernels; None when this TF cannot say."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def local_device_memory(device_type: str = "GPU") -> list[tuple[str, int]]:
    """``(name, memory_limit)`` of each device of ``device_type`` in TF's eager context: for a GPU the limit TF gave
    its allocator (``memory_limit``, virtual devices and ``set_memory_growth`` applied).

    Reads the devices the context already has, through TF's C API (``TFE_ContextListDevices`` and
    ``TF_DeviceListMemoryBytes``, exported by ``libtensorflow_cc.so.2``; the Python bindings expose the list but
    not the memory bytes). ``device_lib.list_local_devices()`` would create a second set of devices (and on a GPU
    a second allocator per device) to answer the same question. Initialises the eager context if it is not yet,
    which creates the devices TF would create at its first op anyway.
    """
    lib = _tf_c_api()
    status = lib.TF_NewStatus()
    devices = None
    try:
        devices = lib.TFE_ContextListDevices(_eager_context_pointer(), status)
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(f"TFE_ContextListDevices failed: {lib.TF_Message(status).decode()}")
        found = []
        for i in range(lib.TF_DeviceListCount(devices)):
            kind = lib.TF_DeviceListType(devices, i, status).decode()
            if kind == device_type:
                found.append((lib.TF_DeviceListName(devices, i, status).decode(),
                              int(lib.TF_DeviceListMemoryBytes(devices, i, status))))
        return found
    finally:
        if devices:
            lib.TF_DeleteDeviceList(devices)
        lib.TF_DeleteStatus(status)


def release_step_resources() -> bool:
    """Empty the eager context's step container after a failed call of a train function; returns whether it did.
    Never raises: it runs inside the callers' ``except ResourceExhaustedError``, whose error must stay the one the
    user sees, so a failure (TF's C API not found, say) is a logged warning.

    Every ``tf.function`` call of the eager context shares one step container (``__per_step_0``), which TF empties
    only when a step ends (``TFE_ContextEndStep``, which nothing in Keras calls). A call that failed between a
    Grappler ``TemporaryVariable`` (an ``AddN`` of a gradient sum accumulated in place) and its
    ``DestroyTemporaryVariable`` leaves the variable there, and the next call of a graph with that node, a plan of
    the same step, fails with ``AlreadyExistsError``. Starting and ending a step empties the container.

    TF counts open *steps* (``EagerContext::num_active_steps_``), not running calls: a call takes a raw pointer to
    the container when it starts, and ``EndStep`` at a count of 0 destroys that container (and every step resource
    in it) under a call still running on another thread, which then crashes (SIGSEGV) or fails. So nothing is
    released while another thread is inside TensorFlow's execution (:func:`_threads_running_tensorflow`); the
    check and the two C calls run holding the GIL (no new call starts from Python during the C calls; one started
    in the few bytecodes between the check and them is not seen). Kernels of an asynchronous eager executor
    (``tf.config.experimental.set_synchronous_execution(False)``) run with no Python frame and are not seen either.
    """
    try:
        start, end = _step_functions()
        ctx = _eager_context_pointer()
        running = _threads_running_tensorflow()
        if running:
            logger.warning("dymem_tf: the failed step's resources were not released: thread(s) %s are running "
                           "TensorFlow, and releasing them would destroy the step resources of those calls. A "
                           "step of the same graph may then fail with AlreadyExistsError; to avoid it, run no "
                           "TensorFlow work on other threads during a fit with DymemCallback.", ", ".join(running))
            return False
        start(ctx)
        end(ctx)
        return True
    except Exception as err:  # pylint: disable=broad-except  (never replace the caller's error)
        logger.warning("dymem_tf: could not release the failed step's resources (%s: %s); a step of the same graph "
                       "may fail with AlreadyExistsError.", type(err).__name__, err)
        return False


def _threads_running_tensorflow() -> list[str]:
    """Names of the other Python threads inside TensorFlow's eager execution: a frame on their stack is TF's
    ``eager/execute.py`` (every ``tf.function`` call and slow-path op) or a generated op wrapper (``gen_*.py``, the
    fast path), whose C call runs kernels with the eager context's step container. Their whole stack is searched:
    a ``py_function`` may run inline on the calling thread, above its ``execute`` frame."""
    import tensorflow as tf

    root = os.path.dirname(os.path.abspath(tf.__file__)) + os.sep
    execute = os.path.join(root, "python", "eager", "execute.py")
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    running = []
    for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
        if ident == threading.get_ident():
            continue
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(root) and (path == execute or os.path.basename(path).startswith("gen_")):
                running.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    del frame
    return running


@functools.lru_cache(maxsize=1)
def _step_functions():
    """``TFE_ContextStartStep`` and ``TFE_ContextEndStep`` as ctypes functions that keep the GIL while they run
    (``PYFUNCTYPE``; the library's own attributes release it), so no call starts from Python meanwhile."""
    import ctypes

    lib = _tf_c_api()
    prototype = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
    return prototype(("TFE_ContextStartStep", lib)), prototype(("TFE_ContextEndStep", lib))


def _eager_context_pointer() -> int:
    """The eager context's ``TFE_Context*`` (initialising the context if it is not yet)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.ensure_initialized()
    return _capsule_pointer()(ctx._context_handle, None)  # pylint: disable=protected-access  (a PyCapsule)


@functools.lru_cache(maxsize=1)
def _capsule_pointer():
    """``PyCapsule_GetPointer`` through a prototype of its own: setting ``ctypes.pythonapi.PyCapsule_GetPointer``'s
    ``restype`` and ``argtypes`` would change them for every other user of ``ctypes.pythonapi`` in the process."""
    import ctypes

    prototype = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
    return prototype(("PyCapsule_GetPointer", ctypes.pythonapi))


@functools.lru_cache(maxsize=1)
def _tf_c_api():
    """TF's C API library (already loaded by ``import tensorflow``), with the signatures this module calls."""
    import ctypes

    import tensorflow as tf

    lib = ctypes.CDLL(os.path.join(os.path.dirname(tf.__file__), "libtensorflow_cc.so.2"))
    vp, i = ctypes.c_void_p, ctypes.c_int
    for name, restype, argtypes in (
            ("TF_NewStatus", vp, []), ("TF_DeleteStatus", None, [vp]), ("TF_GetCode", i, [vp]),
            ("TF_Message", ctypes.c_char_p, [vp]), ("TFE_ContextListDevices", vp, [vp, vp]),
            ("TF_DeviceListCount", i, [vp]), ("TF_DeviceListName", ctypes.c_char_p, [vp, i, vp]),
            ("TF_DeviceListType", ctypes.c_char_p, [vp, i, vp]),
            ("TF_DeviceListMemoryBytes", ctypes.c_int64, [vp, i, vp]), ("TF_DeleteDeviceList", None, [vp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def gpu_memory_limits() -> list[int]:
    """The memory limit TF computed for each GPU of the eager context (no second device set is created)."""
    return [limit for _, limit in local_device_memory("GPU")]


def autoclustering_requested() -> bool:
    """Whether the user turned on XLA auto-clustering for functions (``tf.config.optimizer.set_jit(True)`` or
    ``"autoclustering"``: the session config's ``global_jit_level``)."""
    import tensorflow as tf

    return bool(tf.config.optimizer.get_jit())


def forced_auto_jit_flag() -> str | None:
    """The ``--tf_xla_auto_jit`` value of ``TF_XLA_FLAGS`` when it turns auto-clustering on, else None.

    XLA's ``GetXlaGlobalJitLevel`` (``compiler/jit/xla_cluster_util.cc``) lets this flag override every session
    config, so :func:`autoclustering_off` cannot turn such clustering off for one function."""
    for token in os.environ.get("TF_XLA_FLAGS", "").split():
        if token.startswith("--tf_xla_auto_jit="):
            value = token.split("=", 1)[1].strip()
            return None if value in ("", "0", "-1") else value
    return None


def autoclustering_off():
    """Run the ``tf.function`` calls inside with XLA auto-clustering explicitly off (``global_jit_level=OFF``),
    on this thread only, whatever ``tf.config.optimizer.set_jit`` says: a function instantiated inside keeps its
    ops out of XLA clusters. TF builds each call's ``config_proto`` from the thread's function call options."""
    from tensorflow.core.protobuf import config_pb2

    return _global_jit_level(config_pb2.OptimizerOptions.OFF)


def autoclustering_on():
    """Run the ``tf.function`` calls inside with XLA auto-clustering on (``global_jit_level=ON_2``), on this thread
    only, as ``tf.config.optimizer.set_jit("autoclustering")`` would. On the CPU, XLA clusters only with
    ``TF_XLA_FLAGS=--tf_xla_cpu_global_jit`` set before TensorFlow starts (see :func:`cpu_autoclustering_enabled`)."""
    from tensorflow.core.protobuf import config_pb2

    return _global_jit_level(config_pb2.OptimizerOptions.ON_2)


def cpu_autoclustering_enabled() -> bool:
    """Whether ``TF_XLA_FLAGS`` lets auto-clustering cluster ops placed on the CPU (``--tf_xla_cpu_global_jit``)."""
    for token in os.environ.get("TF_XLA_FLAGS", "").split():
        name, _, value = token.partition("=")
        if name == "--tf_xla_cpu_global_jit":
            return value.strip().lower() not in ("0", "false")
    return False


@contextlib.contextmanager
def _global_jit_level(level):
    """The ``tf.function`` calls inside run with ``global_jit_level=level`` (this thread only)."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    saved = ctx._thread_local_data.function_call_options  # pylint: disable=protected-access  (None: from config)
    options = copy.copy(ctx.function_call_options)
    config = config_pb2.ConfigProto()
    config.ParseFromString(options.config_proto_serialized)
    config.graph_options.optimizer_options.global_jit_level = level
    options.config_proto_serialized = config
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = saved


def registered_kernel_devices(op_name: str) -> set[str]:
    """Device types (``"CPU"``, ``"GPU"``) with a kernel registered for ``op_name`` in this process."""
    return {k.device_type for k in registered_kernel_defs(op_name)}


def registered_kernel_defs(op_name: str) -> list:
    """The ``KernelDef`` protos (device type, type constraints, ``host_memory_arg`` names, label, priority) of every
    kernel registered for ``op_name`` in this process; empty for an unknown op."""
    from tensorflow.python.framework import kernels

    return list(kernels.get_registered_kernels_for_op(op_name).kernel)


def registered_op_def(op_name: str):
    """The ``OpDef`` of ``op_name`` in TF's op registry, or None when no such op is registered."""
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op_name)


def wrap_tf_data_conversion(wrap) -> bool:
    """Replace tf.data's ``normalize_element`` by ``wrap(original)`` once (marked ``_dymem_wrapped``); return
    whether it is wrapped now."""
    try:
        from tensorflow.python.data.util import structure
    except ImportError:  # pragma: no cover - other TF layouts
        return False
    original = getattr(structure, "normalize_element", None)
    if original is None:  # pragma: no cover
        return False
    if not getattr(original, "_dymem_wrapped", False):
        wrapped = wrap(original)
        wrapped._dymem_wrapped = True
        structure.normalize_element = wrapped
    return True


def dataset_batch_size(dataset, depth: int = 0) -> int | None:
    """Static ``batch_size`` of the last ``batch``/``padded_batch`` applied in a ``tf.data`` pipeline, if any."""
    if dataset is None or depth > 64:
        return None
    size = getattr(dataset, "_batch_size", None)
    if size is not None:
        import tensorflow as tf

        value = tf.get_static_value(size) if tf.is_tensor(size) else size
        try:
            return int(value) if value is not None and int(value) > 0 else None
        except (TypeError, ValueError):
            return None
    return dataset_batch_size(getattr(dataset, "_input_dataset", None), depth + 1)


# ------------------------------------------------------------------------------------------------------ Keras

def fit_frame_locals(model) -> dict | None:
    """The local variables of the ``model.fit`` call on the current stack, or None when none is running."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                return dict(frame.f_locals)
            frame = frame.f_back
    finally:
        del frame
    return None


def fit_element_spec(loc: dict | None):
    """The element spec of the dataset the running ``fit`` (its frame locals ``loc``) iterates (the train
    function's input signature), or None when unknown."""
    dataset = getattr(loc.get("epoch_iterator") if loc else None, "_distributed_dataset", None)
    try:
        return dataset.element_spec if dataset is not None else None
    except Exception:  # pylint: disable=broad-except  (an exotic dataset: then nothing is reused across fits)
        return None


def running_callback_list(callback, max_depth: int = 8):
    """The Keras ``CallbackList`` whose hook is calling ``callback`` right now, or None.

    Keras hands a callback no handle on the list that runs it; the list's method that called the callback is on the
    stack, with the list as its ``self``.
    """
    from keras.src.callbacks.callback_list import CallbackList

    frame = sys._getframe(1)  # pylint: disable=protected-access
    try:
        for _ in range(max_depth):
            if frame is None:
                return None
            holder = frame.f_locals.get("self")
            if isinstance(holder, CallbackList) and any(cb is callback for cb in holder.callbacks):
                return holder
            frame = frame.f_back
    finally:
        del frame
    return None


def peeked_batches(adapter) -> list | None:
    """The first batches Keras's ``GeneratorDataAdapter`` peeked from a Python generator (``_first_batches``, to
    build the dataset's signature), or None for other adapters."""
    batches = getattr(adapter, "_first_batches", None) if adapter is not None else None
    return list(batches) if isinstance(batches, (list, tuple)) and batches else None


def all_layers_built(model) -> bool:
    """Whether every layer of ``model`` (``Layer._flatten_layers``, the model included) is built."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = flatten() if callable(flatten) else [model]
    return all(getattr(layer, "built", False) for layer in layers)


def build_without_jit(model, build) -> None:
    """Call ``build()`` with ``model.jit_compile`` off, then put the user's value back exactly (the public setter
    would re-check XLA support and may change it)."""
    has_private = "_jit_compile" in vars(model)
    saved = model._jit_compile if has_private else model.jit_compile  # pylint: disable=protected-access
    model.jit_compile = False
    try:
        build()
    finally:
        if has_private:
            model._jit_compile = saved  # pylint: disable=protected-access
        else:
            model.jit_compile = saved


# ------------------------------------------------------------------------------------------------ warnings

#: packages whose frames a warning about the user's model skips (the pass runs deep inside Keras' fit and TF)
_LIBRARY_PACKAGES = ("dymem_tf", "keras", "tensorflow", "tf_keras")


def warn_user(message: str, category=RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the user's code: the innermost caller outside dymem_tf, Keras and TensorFlow
    (the line that called ``fit``), wherever in them the warning is raised. A fixed ``stacklevel`` cannot do that:
    the pass is called from TF's function instantiation, a varying number of frames below ``fit``."""
    prefixes = tuple(os.path.dirname(module.__file__) + os.sep for module in
                     (sys.modules.get(name) for name in _LIBRARY_PACKAGES) if getattr(module, "__file__", None))
    frame, level = sys._getframe(1), 2  # pylint: disable=protected-access  (level 2: warn_user's caller)
    try:
        while frame is not None and (frame.f_code.co_filename.startswith(prefixes)
                                     or frame.f_code.co_filename.startswith("<frozen ")):
            frame, level = frame.f_back, level + 1
    finally:
        del frame
    warnings.warn(message, category, stacklevel=level)


@contextlib.contextmanager
def new_gradients(keys: list):
    """Append to ``keys`` the names of the gradient functions registered with TensorFlow inside the block.

    Each trace of a Keras train step registers a ``tf.custom_gradient`` (``tf.distribute``'s ``all_reduce`` of
    the gradients, in Keras' optimizer) in TensorFlow's process-wide gradient registry, and the entry's closure
    keeps the traced step's whole ``FuncGraph`` alive for good (tensorflow#97697): about 2 MiB for a small CNN, 50
    MiB for MobileNetV2, per trace, and the model it closes over. The gradient is asked for only inside the trace
    (nothing differentiates through the optimizer's update): :func:`drop_gradients` lets them go once it is done.
    Another thread's trace inside the block would be counted too."""
    registry = _gradient_registry()
    before = len(registry)
    try:
        yield keys
    finally:
        if len(registry) > before:  # entries are only ever added, in order
            keys.extend(name for name in list(registry)[before:] if name.startswith("CustomGradient-"))


def drop_gradients(keys: list) -> None:
    """Remove the gradient functions named ``keys`` from TensorFlow's registry (their traces are done: the graphs
    that use them run without them, and a new trace registers its own)."""
    registry = _gradient_registry()
    for name in keys:
        registry.pop(name, None)


def _gradient_registry() -> dict:
    """TensorFlow's registry of gradient functions, by name (``ops.RegisterGradient``, ``tf.custom_gradient``)."""
    from tensorflow.python.framework import ops

    return ops._gradient_registry._registry  # pylint: disable=protected-access
