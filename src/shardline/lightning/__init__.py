"""shardline for Lightning (``pip install 'shardline[lightning]'``): ``ShardlineStrategy``, and lineage for
Lightning's own strategies: ``LineageFSDPStrategy`` and ``LineageModelParallelStrategy``.

Importing this package registers the strategy with Lightning as ``Trainer(strategy="shardline")``.
"""

from shardline.lightning.lineage import LineageFSDPStrategy, LineageModelParallelStrategy
from shardline.lightning.strategy import ShardlineStrategy

__all__ = ["LineageFSDPStrategy", "LineageModelParallelStrategy", "ShardlineStrategy"]
