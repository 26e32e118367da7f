"""Observability: the summaries writer that feeds the "Dymem" TensorBoard dashboard (``tensorboard_plugin_dymem``).

Import rule: may import :mod:`dymem_tf.planning`, :mod:`dymem_tf.memory` and ``tensorboard_plugin_dymem.logdata``
(the shared on-disk format); the plugin package never imports dymem_tf.
"""
