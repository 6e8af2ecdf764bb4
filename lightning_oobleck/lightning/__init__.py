"""Lightning integration: ``Trainer(strategy="oobleck")`` once this package is imported.

Lightning 2.6 has no entry point for third-party strategies, so importing this package registers the
name ``"oobleck"`` in Lightning's ``StrategyRegistry`` (idempotently).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.lightning.data import DataPosition, GlobalBatchSampler
from lightning_oobleck.lightning.module import MissingPipelineHookError, PipelineModule
from lightning_oobleck.lightning.strategy import OobleckStrategy

if OobleckStrategy.strategy_name not in StrategyRegistry:
    OobleckStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DataPosition",
    "GlobalBatchSampler",
    "MissingPipelineHookError",
    "OobleckConfig",
    "OobleckStrategy",
    "PipelineModule",
]
