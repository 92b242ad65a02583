"""Large-batch optimizers for Keras 3: `lars.LARS` and `lamb.LAMB`, public as `tfdp.optimizers`.

`_exclusion` holds what both share: which variables skip weight decay and the
layer-wise trust ratio.
"""
