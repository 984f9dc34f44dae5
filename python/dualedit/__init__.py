"""dualedit as a Python editing backend.

MEND-style knowledge editing (Rust + libtorch) with the API its users already know:

* :class:`Session` — one loaded model (and trained editor): ``edit``, ``score``,
  ``generate``, ``reset``, ``save``, ``memory``;
* :class:`Editor` / :class:`MultimodalEditor` — EasyEdit's ``BaseEditor.edit`` and
  ``MultimodalEditor.edit`` call shapes and per-record metrics, so an EasyEdit script
  changes one import;
* :func:`train`, :func:`evaluate`, :func:`plan`, :func:`compare` — the CLI's commands,
  returning their reports as dicts.

``import torch`` comes first: the extension links the libtorch of the installed torch
(no second copy), which that import loads.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from ._errors import (
    DeviceError,
    Error,
    FileError,
    InputError,
    IoError,
    NotFoundError,
    OutOfMemoryError,
    TorchError,
    InternalError,
)
from . import _errors
from ._session import Score, Session
from ._easyedit import Editor, MultimodalEditor
from ._runs import compare, evaluate, plan, train

__version__ = "0.1.0"

__all__ = [
    "Session",
    "Score",
    "Editor",
    "MultimodalEditor",
    "train",
    "evaluate",
    "plan",
    "compare",
    *_errors.__all__,
]
