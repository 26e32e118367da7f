"""Keras's own tests run with and without an injected ``DymemCallback`` (see :mod:`tools.keras_conformance.run`)."""
