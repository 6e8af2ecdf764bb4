"""lightning_oobleck: fault-tolerant heterogeneous pipeline training for PyTorch Lightning (Oobleck)."""

__version__ = "0.1.0"
