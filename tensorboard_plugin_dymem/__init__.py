"""TensorBoard "Dymem" dashboard: the swap plan, the modelled memory timeline and the GTBM allocator's state.

:mod:`.logdata` reads what :class:`dymem_tf.observe.summaries.DymemSummaryWriter` writes (pure Python, no TensorFlow);
:mod:`.plugin` serves it to the page in ``static/``.
"""
