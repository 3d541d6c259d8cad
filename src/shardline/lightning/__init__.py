"""shardline for Lightning (``pip install 'shardline[lightning]'``): ``ShardlineStrategy``, and lineage for
Lightning's own strategies: ``LineageFSDPStrategy`` and ``LineageModelParallelStrategy``; ``DiagnosticsCallback``
(``shardline train``'s diagnostics, logged to the trainer's loggers).

Importing this package registers the strategy with Lightning as ``Trainer(strategy="shardline")``.
"""

from shardline.lightning.diagnostics import DiagnosticsCallback
from shardline.lightning.lineage import LineageFSDPStrategy, LineageModelParallelStrategy
from shardline.lightning.strategy import ShardlineStrategy

__all__ = ["DiagnosticsCallback", "LineageFSDPStrategy", "LineageModelParallelStrategy", "ShardlineStrategy"]
