"""shardline for Lightning: ``ShardlineStrategy`` (``pip install 'shardline[lightning]'``).

Importing this package registers the strategy with Lightning as ``Trainer(strategy="shardline")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from shardline.lightning.strategy import ShardlineStrategy

ShardlineStrategy.register_strategies(StrategyRegistry)

__all__ = ["ShardlineStrategy"]
