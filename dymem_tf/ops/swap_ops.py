"""Python wrappers of the ``DymemSwapOut`` / ``DymemSwapIn`` ops.

``swap_out(x)`` copies ``x`` to host memory and ``swap_in(host)`` copies it back to the device; the pair is an
identity in value. Both ops are stateful, so Grappler keeps them where the graph rewrite put them.
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


def _check_dtype(op: str, tensor: tf.Tensor) -> None:
    if tensor.dtype.base_dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"{op} cannot swap a tensor of dtype {tensor.dtype.name}: only numeric and bool tensors can be moved "
            f"to host memory (supported: {names})."
        )


def swap_out(x, name: str | None = None) -> tf.Tensor:
    """Copy ``x`` to host memory (``DymemSwapOut``); returns the host tensor, same dtype, shape and value.

    On the CPU device the copy lives in dymem's host pool, outside the device allocator's budget; on a GPU it is
    pinned host memory. Raises ``TypeError`` for non-numeric dtypes (string, variant, resource).
    """
    x = tf.convert_to_tensor(x)
    _check_dtype("DymemSwapOut", x)
    return load_ops_library().dymem_swap_out(x, name=name)


def swap_in(host, name: str | None = None) -> tf.Tensor:
    """Copy a swapped-out tensor back into device memory (``DymemSwapIn``), tagged MOBILE for GTBM."""
    host = tf.convert_to_tensor(host)
    _check_dtype("DymemSwapIn", host)
    return load_ops_library().dymem_swap_in(host, name=name)


def _identity_gradient(op, grad):  # pylint: disable=unused-argument
    # The pair is an identity in value. The graph rewrite inserts it after the gradient is built, so this is only
    # used when a user differentiates through the ops directly; the gradient itself is not swapped.
    return grad


for _op_type in ("DymemSwapOut", "DymemSwapIn"):
    try:
        tf.RegisterGradient(_op_type)(_identity_gradient)
    except KeyError:  # already registered (module reloaded)
        pass
