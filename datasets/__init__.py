"""Event store, raw-format readers, synthetic generator and the ``sven data`` CLI.

Installed as ``sven.datasets``; always import it under that name.
"""
