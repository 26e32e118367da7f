"""The graph pass after Grappler: the native hook's ctypes bridge, the GraphDef view, capture into a step graph,
and the pass that plans it and hands the plan back to the applier in ``cc/pass/step_plan.cc``.

Import rule: may import :mod:`dymem_tf.planning`, :mod:`dymem_tf.memory` and TensorFlow; never Keras or
:mod:`dymem_tf.keras`.
"""
