"""TensorFlow wrappers of dymem_tf's custom ops (``DymemSwapOut`` / ``DymemSwapIn``), loaded by :mod:`dymem_tf.memory.native`."""
