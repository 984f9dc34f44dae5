"""PEP 517 build backend: maturin, with the environment the libtorch link needs.

tch's build script (torch-sys) finds libtorch by running ``python`` (or ``python3``)
from PATH when ``LIBTORCH_USE_PYTORCH`` is set. Under ``pip install .`` neither is
guaranteed: this sets ``LIBTORCH_USE_PYTORCH=1`` and puts the installing interpreter's
folder first on PATH (with ``VIRTUAL_ENV`` pointing at its environment), so the extension
links the torch of the environment it is installed into, whether or not that environment
was activated. Everything else is maturin's.
"""

import os
import sys

from maturin import *  # noqa: F401,F403  (the PEP 517 hooks)
from maturin import build_wheel as _build_wheel  # noqa: F401


def _prepare_env() -> None:
    os.environ.setdefault("LIBTORCH_USE_PYTORCH", "1")
    # The interpreter pip runs this backend with is the target environment's.
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("VIRTUAL_ENV", sys.prefix)


_prepare_env()
