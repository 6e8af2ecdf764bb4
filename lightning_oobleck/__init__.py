"""lightning_oobleck: fault-tolerant heterogeneous pipeline training for PyTorch Lightning (Oobleck).

Importing the package registers the strategy name ``"oobleck"`` with Lightning's ``StrategyRegistry``.
"""

from lightning_oobleck.lightning import OobleckStrategy, PipelineModule

__all__ = ["OobleckStrategy", "PipelineModule"]
__version__ = "0.1.0"
