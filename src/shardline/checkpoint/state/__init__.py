"""The state a checkpoint holds: model state dicts of three kinds (``model_state``), optimizer
state keyed by parameter name (``optim_state``), RNG state (``rng``).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
