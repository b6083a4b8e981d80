"""Vertex partitioning for vertex-owned memory, its on-disk format and cost model.

Installed as ``sven.partition``; always import it under that name.
"""
