"""The command that adds an optional extra (``plot``, ``tensorboard``, ``mpi``, ``gpu``)
to this installation of Sven, as it was installed.

A hint to run ``pip install 'sven[plot]'`` is wrong for a user who installed Sven from
its repository (the guide's ``pip install -e .``): it would fetch another copy from a
package index. The hint names this interpreter's pip, and the checkout when Sven runs
from one.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

__all__ = ["install_hint"]


def install_hint(extra: str, package_dir: Path | None = None) -> str:
    """``PYTHON -m pip install ...`` for ``extra``, matching how Sven was installed.

    Args:
        extra: The optional dependency group of ``pyproject.toml``.
        package_dir: The ``sven`` package folder (default: this one).

    Returns:
        ``-e 'CHECKOUT[extra]'`` when the package lives in a checkout (a folder with
        ``pyproject.toml`` above it: an editable install), else ``'sven[extra]'``.
    """
    here = package_dir or Path(__file__).resolve().parent
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    checkout = here.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "datasets").is_dir():
        return f"{pip} -e {shlex.quote(f'{checkout}[{extra}]')}"
    return f"{pip} {shlex.quote(f'sven[{extra}]')}"
