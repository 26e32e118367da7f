"""The planning core: step graph and dependency layers, cost model, device profiles, simulator, planner, plan.

Import rule: nothing in this package imports TensorFlow, Keras or another dymem_tf sub-package (only
:mod:`dymem_tf.units`); it works on the typed :class:`~dymem_tf.planning.analysis.StepGraph` that
:mod:`dymem_tf.passes` builds, and returns a :class:`~dymem_tf.planning.plan.Plan` (data). ``tests/test_layering.py``
enforces this.
"""
