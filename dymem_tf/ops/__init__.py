"""Python wrappers of dymem_tf's custom TensorFlow ops and the native library loader."""
