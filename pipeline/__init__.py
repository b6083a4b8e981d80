"""Per-rank pipeline: batches, negatives, temporal sampling, memory exchange.

Installed as ``sven.pipeline``; always import it under that name.
"""
