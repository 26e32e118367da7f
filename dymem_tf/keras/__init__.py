"""The Keras integration: :class:`~dymem_tf.keras.callback.DymemCallback`, the guard that cleans up every exit of
``fit``, and the dry run that traces a model's train step and plans it offline.

Import rule: the top of the stack; may import every other dymem_tf sub-package. Nothing imports it but the public
API in ``dymem_tf/__init__.py`` and the CLI.
"""
