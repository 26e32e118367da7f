"""Memory: the GTBM allocator's Python API, the host pool, trace replay, and the one loader of the native libraries.

Import rule: may import :mod:`dymem_tf.units`; TensorFlow only inside functions that need it, so that
:mod:`dymem_tf.memory.replay` (and :mod:`dymem_tf.memory.native`) import and run without TensorFlow.
"""
