"""The cyclic garbage collector paused over a CLI run's start-up (imports to the end of
the first training step), then given only what is made after it.

Importing torch and Sven and building a run leaves a few hundred thousand objects that
the collector tracks, nearly all alive to the process's end; start-up triggers several
full passes over them (docs/performance.md, "Start-up", has their cost). :func:`pause`
turns the collector off; :func:`resume` moves every object alive then into the
permanent generation (``gc.freeze``: later passes skip them) and turns it back on.
Start-up's own cyclic garbage, a few thousand objects, stays with the frozen ones. Only
the command line pauses (one run per process); a library user's process is left alone,
and :func:`resume` does nothing where :func:`pause` did not turn the collector off.

Free of torch, so that the pause covers torch's import.
"""

from __future__ import annotations

import gc

__all__ = ["pause", "paused", "resume"]

_paused = False


def pause() -> None:
    """Turns the collector off, where it is on, until :func:`resume`."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def paused() -> bool:
    """Whether :func:`pause` has the collector off."""
    return _paused


def resume() -> None:
    """Freezes the objects alive now out of the collector's passes and turns it back on,
    where :func:`pause` turned it off; else nothing."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
