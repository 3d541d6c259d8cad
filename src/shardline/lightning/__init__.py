"""shardline for Lightning: ``ShardlineStrategy`` (``pip install 'shardline[lightning]'``).

Importing this package registers the strategy with Lightning as ``Trainer(strategy="shardline")``.
"""

from shardline.lightning.strategy import ShardlineStrategy

__all__ = ["ShardlineStrategy"]
