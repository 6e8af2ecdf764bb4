"""Adapters from model libraries to pipeline layers (extras: ``pip install lightning-oobleck[hf]``)."""
