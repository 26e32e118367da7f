"""Python wrappers of the ``DymemSwapOut`` / ``DymemSwapIn`` ops and of the variable offloading ops.

``swap_out(x)`` copies ``x`` to host memory and ``swap_in(host)`` copies it back to the device; the pair is an
identity in value, as is ``swap_in_partial(*swap_out_partial(x, rows))``, which keeps ``x``'s first rows on the
device. ``offload_variable`` / ``bring_back_variable`` move a resource variable's value to host memory
and back (``DymemVariableSwapOut`` / ``DymemVariableSwapIn``, which the graph rewrite inserts around optimizer
state). Both ops are stateful, so Grappler keeps them where the graph rewrite put them.
"""
from __future__ import annotations

import tensorflow as tf

from dymem_tf.memory.native import load_ops_library

# Every dtype whose tensors are plain bytes; must match DYMEM_SWAP_TYPES in dymem_tf/cc/ops/swap_ops.cc.
SUPPORTED_DTYPES: tuple[tf.DType, ...] = (
    tf.float16, tf.bfloat16, tf.float32, tf.float64,
    tf.int8, tf.int16, tf.int32, tf.int64,
    tf.uint8, tf.uint16, tf.uint32, tf.uint64,
    tf.complex64, tf.complex128, tf.bool,
)


#: What the swap ops take besides those: variant tensors of TensorLists (a while loop's accumulators), whose
#: elements are copied one by one, on the CPU device only (no GPU kernel takes variant).
LIST_DTYPES: tuple[tf.DType, ...] = (tf.variant,)


def _check_dtype(op: str, tensor: tf.Tensor) -> None:
    if tensor.dtype.base_dtype not in SUPPORTED_DTYPES + LIST_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"{op} cannot swap a tensor of dtype {tensor.dtype.name}: only numeric and bool tensors, and variant "
            f"tensors of TensorLists, can be moved to host memory (supported: {names}, variant)."
        )


def swap_out(x, name: str | None = None) -> tf.Tensor:
    """Copy ``x`` to host memory (``DymemSwapOut``); returns the host tensor, same dtype, shape and value.

    On the CPU device the copy lives in dymem's host pool, outside the device allocator's budget; on a GPU it is
    pinned host memory. A variant tensor of TensorLists (CPU device) becomes one of new TensorLists, same element
    shape, dtype and maximum size, whose elements are host-pool copies. Raises ``TypeError`` for string and
    resource tensors (``InvalidArgumentError`` from the op for a variant that holds no TensorList).
    """
    x = tf.convert_to_tensor(x)
    _check_dtype("DymemSwapOut", x)
    return load_ops_library().dymem_swap_out(x, name=name)


def swap_in(host, name: str | None = None) -> tf.Tensor:
    """Copy a swapped-out tensor back into device memory (``DymemSwapIn``), tagged MOBILE for GTBM; a swapped-out
    TensorList comes back as a new one whose elements are device copies."""
    host = tf.convert_to_tensor(host)
    _check_dtype("DymemSwapIn", host)
    return load_ops_library().dymem_swap_in(host, name=name)


def swap_out_partial(x, keep_rows: int, name: str | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Copy all but the first ``keep_rows`` rows of ``x`` (along its first dimension) to host memory, and those
    rows into a new device tensor (``DymemSwapOutPartial``; all rows when ``x`` has fewer); returns
    ``(host, kept)``. Numeric and bool tensors of rank 1 or more; ``keep_rows`` at least 1."""
    x = tf.convert_to_tensor(x)
    if x.dtype.base_dtype not in SUPPORTED_DTYPES:
        _check_dtype("DymemSwapOutPartial", x)
        raise TypeError("DymemSwapOutPartial cannot split a variant tensor: swap it whole (swap_out)")
    if int(keep_rows) < 1:
        raise ValueError(f"keep_rows must be at least 1, got {keep_rows!r}: a swap that keeps nothing is swap_out")
    return tuple(load_ops_library().dymem_swap_out_partial(x, keep_rows=int(keep_rows), name=name))


def swap_in_partial(host, kept, name: str | None = None) -> tf.Tensor:
    """The tensor :func:`swap_out_partial` split, in one new device buffer tagged MOBILE (``DymemSwapInPartial``):
    ``kept``'s rows, then ``host``'s."""
    host, kept = tf.convert_to_tensor(host), tf.convert_to_tensor(kept)
    _check_dtype("DymemSwapInPartial", host)
    return load_ops_library().dymem_swap_in_partial(host, kept, name=name)


def variable_is_offloaded(variable) -> bool:
    """Whether ``variable``'s value currently lives in host memory (offloaded by a plan between its uses)."""
    return bool(load_ops_library().dymem_variable_is_offloaded(_handle(variable)).numpy())


def offload_variable(variable) -> None:
    """Move ``variable``'s value to host memory (``DymemVariableSwapOut``; CPU device); reads still see it."""
    load_ops_library().dymem_variable_swap_out(_handle(variable))


def bring_back_variable(variable) -> bool:
    """Move an offloaded ``variable``'s value back into device memory (``DymemVariableSwapIn``); returns whether
    it was offloaded."""
    was = variable_is_offloaded(variable)
    if was:
        load_ops_library().dymem_variable_swap_in(_handle(variable))
    return was


def bring_back_variables(variables) -> int:
    """:func:`bring_back_variable` for each of ``variables`` on a CPU device (for a distributed variable, each
    replica's); returns how many were offloaded."""
    count = 0
    for v in variable_components(variables):
        handle = variable_handle(v)
        if handle is not None and "GPU" not in (handle.device or "").upper():
            count += bring_back_variable(v)
    return count


def variable_components(variables):
    """Each variable, or for a distributed one its per-replica variables (``.values``)."""
    for v in variables:
        if variable_handle(v) is not None:
            yield v
            continue
        inner = getattr(v, "_value", None) or v  # Keras 3 wraps the tf.Variable
        yield from getattr(inner, "values", ())


def variable_handle(variable):
    """The resource handle of a ``tf.Variable`` or a Keras variable, or None when it has no single handle (a
    distributed variable read outside its replicas)."""
    try:
        return getattr(variable, "handle", None)  # tf.Variable; Keras 3's TF-backend variables forward it
    except (ValueError, TypeError, AttributeError, NotImplementedError):
        return None


def _handle(variable):
    """The resource handle of a ``tf.Variable`` or a Keras variable; TypeError for anything else."""
    handle = variable_handle(variable)
    if handle is None:
        raise TypeError(f"expected a resource variable with one handle, got {type(variable).__name__}")
    return handle


def _identity_gradient(op, grad):  # pylint: disable=unused-argument
    # The pair is an identity in value. The graph rewrite inserts it after the gradient is built, so this is only
    # used when a user differentiates through the ops directly; the gradient itself is not swapped.
    return grad


def _partial_out_gradient(op, grad_host, grad_kept):
    # the rows split, joined again: the kept rows come first
    parts = [g if g is not None else tf.zeros_like(t)
             for g, t in ((grad_kept, op.outputs[1]), (grad_host, op.outputs[0]))]
    return tf.concat(parts, axis=0)


def _partial_in_gradient(op, grad):
    rows = tf.shape(op.inputs[1])[0]
    return grad[rows:], grad[:rows]


for _op_type, _gradient in (("DymemSwapOut", _identity_gradient), ("DymemSwapIn", _identity_gradient),
                            ("DymemSwapOutPartial", _partial_out_gradient),
                            ("DymemSwapInPartial", _partial_in_gradient)):
    try:
        tf.RegisterGradient(_op_type)(_gradient)
    except KeyError:  # already registered (module reloaded)
        pass
