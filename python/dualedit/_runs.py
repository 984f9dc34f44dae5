"""The CLI's commands as functions: :func:`train`, :func:`evaluate`, :func:`plan`,
:func:`compare`. Each returns the command's ``--json`` report as a dict; the long ones
release the GIL, show progress and stop cleanly on Ctrl-C (``KeyboardInterrupt``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, Optional, Union

from . import _native
from ._errors import InputError
from ._session import PathLike, _options

Progress = Union[bool, Callable[[int, int, Dict[str, Any]], None], None]


class _Bar:
    """Per-record progress: a tqdm bar when tqdm is installed, plain lines on stderr
    otherwise (every 10 % or so), or the caller's ``callback(done, total, metrics)``."""

    def __init__(self, progress: Progress, total: int, desc: str) -> None:
        self.callback = progress if callable(progress) else None
        self.tqdm = None
        self.total = total
        self.desc = desc
        self.last_line = -1
        if progress is True or progress is None:
            try:
                from tqdm.auto import tqdm

                self.tqdm = tqdm(total=total or None, desc=desc, unit="record", file=sys.stderr)
            except ImportError:
                pass
        self.plain = progress is True or progress is None

    def __call__(self, done: int, total: int, metrics: str) -> None:
        m = json.loads(metrics) if metrics else {}
        if self.callback is not None:
            self.callback(done, total, m)
        elif self.tqdm is not None:
            if total and self.tqdm.total != total:  # known once the data set is read
                self.tqdm.total = total
                self.tqdm.refresh()
            self.tqdm.update(done - self.tqdm.n)
            if "reliability" in m:
                self.tqdm.set_postfix(reliability=f"{m['reliability']:.2f}", refresh=False)
        elif self.plain:
            step = max(1, (total or 100) // 10)
            if done // step != self.last_line or done == total:
                self.last_line = done // step
                of = f"/{total}" if total else ""
                print(f"{self.desc}: {done}{of} records", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()


def train(
    model: PathLike,
    data: PathLike,
    ds: str,
    config: PathLike,
    out: PathLike,
    *,
    progress: bool = True,
    **options: Any,
) -> Dict[str, Any]:
    """``dualedit train``: meta-trains a MEND editor on ``data`` (``ds``: zsre,
    counterfact, vqa, caption) with the hyper-parameters in ``config``, into ``out``.

    Options as the CLI's flags: ``device``, ``sub_device``, ``dtype``, ``placement``,
    ``optimizer_device``, ``max_memory``, ``seed``, ``report``, ``max_steps``, ``limit``,
    ``resume``, ``init``, ``recompute``, ``truncate``, ``strict``, ``image_root``,
    ``rephrase_image_root``. ``progress`` shows the library's step bar on stderr.

    Returns the training report (steps, losses, validations, the editor's folder) with
    ``report``: the path of the full run report.
    """
    return json.loads(_native.train(_options(model=model, data=data, ds=ds, config=config, out=out, progress=progress, **options)))


def evaluate(
    model: PathLike,
    data: PathLike,
    ds: str,
    editor: Optional[PathLike] = None,
    *,
    progress: Progress = True,
    **options: Any,
) -> Dict[str, Any]:
    """``dualedit eval``: edits each record of ``data`` from the unedited model and
    measures it (EasyEdit's protocol), or in groups with ``edits_per_batch=N`` /
    ``sequential=N``.

    Options as the CLI's flags: ``method`` (mend, mend-ls, ft, unedited), ``device``,
    ``sub_device``, ``dtype``, ``placement``, ``max_memory``, ``limit``, ``max_length``,
    ``drift_text``, ``guard`` and ``guard_*``, ``stepwise``, ``ft_lr``, ``ls_*``,
    ``report``, ``truncate``, ``strict``, ``image_root``, ``rephrase_image_root``.
    ``progress``: True (tqdm when installed, else plain lines), False, or a callback
    ``(done, total, record_metrics)``.

    Returns ``eval --json``'s object: the summary's means, ``method``, ``records``,
    ``data`` and ``report``.
    """
    bar = _Bar(progress, options.get("limit") or 0, "eval") if progress else None
    try:
        return json.loads(_native.evaluate(_options(model=model, data=data, ds=ds, editor=editor, **options), progress=bar))
    finally:
        if bar is not None:
            bar.close()


def plan(model: PathLike, config: PathLike, **options: Any) -> Dict[str, Any]:
    """``dualedit plan``: each device's peak memory for training and editing, from the
    model's config.json alone (the devices need not exist here).

    Options: ``plan``'s flags as keywords: ``device``, ``sub_device``, ``dtype``,
    ``placement`` (replica, balanced, auto), ``optimizer_device``, ``max_memory``
    (planned against, not applied), ``margin``, ``reserve``, ``fit``, ``data`` with ``ds``
    (and ``image_root``, ``percentile``), ``max_length``, ``kept_tokens``,
    ``image_size=(w, h)``, ``loc_length``.
    Returns ``plan --json``'s object: one placement's plan, or with a sub-device and no
    placement the table of every placement.
    """
    if options.get("image_size") is not None:
        options["image_size"] = [int(x) for x in options["image_size"]]
    return json.loads(_native.plan(_options(model=model, config=config, **options)))


def compare(command: str, *args: Any, **options: Any) -> Dict[str, Any]:
    """``dualedit compare train|eval``: the same run on the main device alone and on
    main + ``sub_device``, side by side. ``command`` is ``"train"`` or ``"eval"``; the
    other arguments are :func:`train`'s or :func:`evaluate`'s (``sub_device`` required).
    Returns ``compare --json``'s object.
    """
    if "sub_device" not in options or options["sub_device"] is None:
        raise InputError("compare needs sub_device (the dual side's sub-device)")
    if command == "train":
        names = ("model", "data", "ds", "config", "out")
        given = list(args) + [options.pop(k, None) for k in names[len(args):]]
        missing = [n for n, v in zip(names, given) if v is None]
        if missing:
            raise InputError(f"compare('train', ...) needs {', '.join(missing)}")
        model, data, ds, config, out = given[:5]
        options.pop("progress", None)
        return json.loads(_native.train(_options(model=model, data=data, ds=ds, config=config, out=out, compare=True, **options)))
    if command == "eval":
        names = ("model", "data", "ds", "editor")
        given = list(args) + [options.pop(k, None) for k in names[len(args):]]
        missing = [n for n, v in zip(names[:3], given) if v is None]
        if missing:
            raise InputError(f"compare('eval', ...) needs {', '.join(missing)}")
        model, data, ds, editor = given[:4]
        options.pop("progress", None)
        return json.loads(_native.evaluate(_options(model=model, data=data, ds=ds, editor=editor, compare=True, **options)))
    raise InputError(f"compare runs 'train' or 'eval', not {command!r}")
