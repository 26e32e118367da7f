"""The batch size of the running ``fit``, which Keras does not hand to callbacks: read from its frame and its data
adapter (:func:`dymem_tf.compat.fit_frame_locals`)."""
from __future__ import annotations

import numbers

import tensorflow as tf

from dymem_tf import compat


def fit_batch_size(loc: dict | None) -> int | None:
    """The batch size of the ``fit`` call that is running (global, over all replicas), or None when unknown.

    A traced step's batch dimension is unknown when the data has a partial last batch (NumPy data whose length is
    not a multiple of the batch size) or comes from a dataset batched without ``drop_remainder``; the planner then
    needs the largest batch the step will see. Keras hands callbacks no batch size, so this reads the locals ``loc``
    of the ``fit`` frame that called ``on_train_begin`` (:func:`dymem_tf.compat.fit_frame_locals`): its data
    adapter's batch size, or the ``batch`` call of a ``tf.data`` pipeline.
    """
    if loc is None:
        return None
    adapter = getattr(loc.get("epoch_iterator"), "data_adapter", None)
    for candidate in (_safe_attr(adapter, "batch_size"), loc.get("batch_size"),
                      compat.dataset_batch_size(getattr(adapter, "_dataset", None))):
        if isinstance(candidate, int) and not isinstance(candidate, bool) and candidate > 0:
            return candidate
    return None


def observed_batch_size(loc: dict | None) -> int | None:
    """The batch size of the first batches of a Python generator, as Keras's ``GeneratorDataAdapter`` peeked them
    (``_first_batches``, to build the dataset's signature), or None.

    An observation, not a bound: a later batch may be larger, so the pass plans with it only without a
    ``memory_budget`` (:attr:`dymem_tf.passes.step_pass.StepPass.observed_batch_size`). None when the peeked batches do not
    tell one batch size: a leaf without a leading dimension, or leaves whose leading dimensions differ. The
    ``PyDataset`` adapter keeps no batch; reading one again would call the user's ``__getitem__`` once more (and
    advance any random state it draws from), so its batch size stays unknown.
    """
    adapter = getattr(loc.get("epoch_iterator"), "data_adapter", None) if loc is not None else None
    batches = compat.peeked_batches(adapter)
    if not isinstance(batches, (list, tuple)) or not batches:
        return None
    sizes = [leading_dim(batch) for batch in batches]
    if any(size is None for size in sizes):
        return None
    return max(sizes)


def leading_dim(batch) -> int | None:
    """The leading dimension shared by every array of one batch (``None`` entries aside), or None.

    None too when the batch holds a sparse or ragged array: the step's tensors of unknown leading dimension then
    include value counts (a sparse input's values, ``embedding_lookup_sparse``'s ids) that the batch size, which
    the pass puts in every unknown leading dimension, does not bound."""
    dims = set()
    for leaf in tf.nest.flatten(batch):
        if leaf is None:
            continue
        kind = type(leaf)
        if (kind.__name__ in ("SparseTensor", "RaggedTensor", "SparseTensorValue", "RaggedTensorValue")
                or kind.__module__.startswith(("scipy.sparse", "jax.experimental.sparse"))):
            return None
        shape = _safe_attr(leaf, "shape")
        try:
            first = tuple(shape)[0] if shape is not None else None
        except (TypeError, ValueError, IndexError):  # unknown rank, or a scalar
            return None
        if isinstance(first, bool) or not isinstance(first, numbers.Integral) or first <= 0:
            return None
        dims.add(int(first))
    return dims.pop() if len(dims) == 1 else None


def _safe_attr(obj, name):
    try:
        return getattr(obj, name, None)
    except Exception:  # pylint: disable=broad-except  (a data adapter property may fail on exotic data)
        return None
