"""EasyEdit's call shapes over a :class:`~dualedit.Session`.

``BaseEditor.edit`` and ``MultimodalEditor.edit`` take lists of prompts / targets and
return ``(metrics, edited_model, weights_copy)`` with one metrics dict per record; these
classes take the same arguments and return the same shape, so an EasyEdit script changes
its import (and how the editor is built) only. ``edited_model`` is the
:class:`~dualedit.Session`, whose :meth:`~dualedit.Session.reset` plays the role of
``weights_copy`` (returned as ``None``).

As in EasyEdit, ``sequential_edit=False`` edits each record from the unedited model
(each edit is undone before the next, by :meth:`~dualedit.Session.reset`, which also
undoes edits kept by an earlier call), and ``sequential_edit=True`` keeps every edit and
measures all records after the last one.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._errors import InputError
from ._session import PathLike, Session

StrOrList = Union[str, Sequence[str]]


def _as_list(name: str, v: Any, n: Optional[int]) -> Optional[List[Any]]:
    """``v`` as a list of ``n`` items (a single value is repeated only when ``n`` is 1)."""
    if v is None:
        return None
    items = [v] if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) else list(v)
    if n is not None and len(items) != n:
        raise InputError(f"{name} has {len(items)} item(s) for {n} prompt(s)")
    return items


def _keyed(name: str, inputs: Optional[Mapping[str, Any]], n: int, fields: Sequence[str]) -> Optional[Tuple[str, Dict[str, List[Any]]]]:
    """EasyEdit's ``{key: {"prompt": [...], "ground_truth": [...]}}`` inputs, one key."""
    if not inputs:
        return None
    if not isinstance(inputs, Mapping):
        raise InputError(f"{name} must be a dict like {{'neighborhood': {{'prompt': [...], 'ground_truth': [...]}}}}")
    if len(inputs) != 1:
        raise InputError(f"{name}: dualedit measures one {name.split('_')[0]} set per record; got the keys {sorted(inputs)}")
    key, value = next(iter(inputs.items()))
    if not isinstance(value, Mapping):
        raise InputError(f"{name}[{key!r}] must be a dict with {', '.join(map(repr, fields))}")
    out = {}
    for f in fields:
        if f not in value:
            raise InputError(f"{name}[{key!r}] has no {f!r}")
        out[f] = _as_list(f"{name}[{key!r}][{f!r}]", value[f], n)
    return key, out


def _prompts(prompts: StrOrList, kwargs: Mapping[str, Any]) -> List[str]:
    """``edit``'s prompts as a list of at least one; ``kwargs`` (EasyEdit arguments this
    does not take) must be empty: one clear error rather than an argument ignored."""
    if kwargs:
        raise InputError(f"unsupported arguments: {', '.join(sorted(kwargs))}")
    prompts_l = _as_list("prompts", prompts, None) or []
    if not prompts_l:
        raise InputError("no prompts")
    return prompts_l


def _from_hparams(hparams: Any, session_options: Dict[str, Any]) -> Tuple[Any, Any]:
    """``(model, editor)`` from EasyEdit's hparams (an object or a dict): ``model_name``,
    ``archive``; its ``device`` (an int is a CUDA index) goes into ``session_options``."""
    get = (lambda k: hparams.get(k)) if isinstance(hparams, Mapping) else (lambda k: getattr(hparams, k, None))
    model = get("model_name")
    if model is None:
        raise InputError("hparams has no model_name (the model folder)")
    device = get("device")
    if device is not None and "device" not in session_options:
        session_options["device"] = f"cuda:{device}" if isinstance(device, int) else str(device)
    return model, get("archive")


def _keep_original_weight(kwargs: Dict[str, Any]) -> None:
    """EasyEdit's ``keep_original_weight``: accepted and, as in EasyEdit's current editors,
    without effect (``sequential_edit`` decides whether edits are kept)."""
    kwargs.pop("keep_original_weight", None)


def _one(v: Optional[List[Any]]) -> Optional[List[float]]:
    return None if v is None else [v]


class Editor:
    """``dualedit.Editor(model, editor, ...)``: EasyEdit's ``BaseEditor`` for a dualedit
    MEND editor. The arguments are :class:`~dualedit.Session`'s (device, dtype, guard, ...).
    """

    def __init__(self, model: PathLike, editor: Optional[PathLike] = None, **session_options: Any) -> None:
        self.session = Session(model, editor, **session_options)

    @classmethod
    def from_hparams(cls, hparams: Any, **session_options: Any) -> "Editor":
        """From EasyEdit-style hyper-parameters: ``model_name`` (the model folder),
        ``archive`` (the trained editor folder) and optionally ``device``."""
        return cls(*_from_hparams(hparams, session_options), **session_options)

    def edit(
        self,
        prompts: StrOrList,
        target_new: StrOrList,
        ground_truth: Optional[StrOrList] = None,
        rephrase_prompts: Optional[StrOrList] = None,
        locality_inputs: Optional[Mapping[str, Any]] = None,
        portability_inputs: Optional[Mapping[str, Any]] = None,
        sequential_edit: bool = False,
        subject: Optional[StrOrList] = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> Tuple[List[Dict[str, Any]], Session, None]:
        """Edits and measures as EasyEdit's ``BaseEditor.edit``.

        Returns ``(metrics, session, None)``; ``metrics[i]`` holds ``case_id``,
        ``requested_rewrite``, ``time``, ``pre`` (``rewrite_acc``, ``rephrase_acc``,
        ``portability``) and ``post`` (the same and ``locality``: ``{key + "_acc": [...]}``),
        each accuracy a one-element list as EasyEdit writes them, and ``refused`` (the
        commit guard refused the edit, nothing of it was committed: ``post`` is the
        weights without it) with the guard's ``refused_reason`` (``None`` when committed).
        """
        _keep_original_weight(kwargs)
        prompts_l = _prompts(prompts, kwargs)
        n = len(prompts_l)
        targets = _as_list("target_new", target_new, n)
        truths = _as_list("ground_truth", ground_truth, n)
        rephrases = _as_list("rephrase_prompts", rephrase_prompts, n)
        subjects = _as_list("subject", subject, n)
        loc = _keyed("locality_inputs", locality_inputs, n, ("prompt", "ground_truth"))
        port = _keyed("portability_inputs", portability_inputs, n, ("prompt", "ground_truth"))
        requests = []
        for i in range(n):
            r: Dict[str, Any] = {"prompt": prompts_l[i], "target_new": targets[i]}
            if truths is not None and truths[i] is not None and truths[i] != "<|endoftext|>":
                r["ground_truth"] = truths[i]
            if subjects is not None:
                r["subject"] = subjects[i]
            if rephrases is not None:
                r["rephrase_prompt"] = rephrases[i]
            if loc is not None:
                r["locality_prompt"] = loc[1]["prompt"][i]
                r["locality_ground_truth"] = loc[1]["ground_truth"][i]
            if port is not None:
                p, a = port[1]["prompt"][i], port[1]["ground_truth"][i]
                if isinstance(p, (list, tuple)):
                    r["portability"] = [{"prompt": pp, "ground_truth": aa} for pp, aa in zip(p, a if isinstance(a, (list, tuple)) else [a] * len(p))]
                else:
                    r["portability"] = {"prompt": p, "ground_truth": a}
            requests.append(r)

        s = self.session
        pre = s.measure(requests)
        if sequential_edit:
            t0 = time.perf_counter()
            report = s.edit(requests, sequential=True)
            per = (time.perf_counter() - t0) / n
            posts = [(q, per) for q in report["requests"]]
        else:
            posts = []
            for r in requests:
                t0 = time.perf_counter()
                report = s.edit([r])
                posts.append((report["requests"][0], time.perf_counter() - t0))
                s.reset()
        metrics = []
        for i, (r, before, (after, seconds)) in enumerate(zip(requests, pre, posts)):
            m_pre: Dict[str, Any] = {"rewrite_acc": [before["reliability"]]}
            m_post: Dict[str, Any] = {"rewrite_acc": [after["reliability"]], "locality": {}, "portability": {}}
            m_pre["portability"] = {}
            if after.get("generalization") is not None:
                m_pre["rephrase_acc"] = [before["generalization"]]
                m_post["rephrase_acc"] = [after["generalization"]]
            if loc is not None and after.get("locality") is not None:
                m_post["locality"][f"{loc[0]}_acc"] = [after["locality"]]
            if port is not None and after.get("portability") is not None:
                m_pre["portability"][f"{port[0]}_acc"] = [before["portability"]]
                m_post["portability"][f"{port[0]}_acc"] = [after["portability"]]
            metrics.append(
                {
                    "case_id": i,
                    "requested_rewrite": r,
                    "time": seconds,
                    "pre": m_pre,
                    "post": m_post,
                    # The commit guard refused this edit: post is the weights without it.
                    "refused": after["refused"],
                    "refused_reason": after["refused_reason"],
                }
            )
            if verbose:
                print(f"{i} editing: {r['prompt']} -> {r['target_new']}  {metrics[-1]['post']}")
        return metrics, s, None


class MultimodalEditor:
    """``dualedit.MultimodalEditor(model, editor, ...)``: EasyEdit's ``MultimodalEditor``
    for a Qwen2-VL model and a dualedit MEND editor trained on it."""

    def __init__(self, model: PathLike, editor: Optional[PathLike] = None, **session_options: Any) -> None:
        self.session = Session(model, editor, **session_options)

    @classmethod
    def from_hparams(cls, hparams: Any, **session_options: Any) -> "MultimodalEditor":
        """As :meth:`Editor.from_hparams`: ``model_name`` (the Qwen2-VL folder), ``archive``
        (the trained editor folder) and optionally ``device``."""
        return cls(*_from_hparams(hparams, session_options), **session_options)

    def edit(
        self,
        prompts: StrOrList,
        targets: StrOrList,
        image: Any,
        file_type: Optional[StrOrList] = None,
        rephrase_prompts: Optional[StrOrList] = None,
        rephrase_image: Any = None,
        locality_inputs: Optional[Mapping[str, Any]] = None,
        sequential_edit: bool = False,
        image_root: Optional[PathLike] = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> Tuple[List[Dict[str, Any]], Session, None]:
        """Edits and measures as EasyEdit's ``MultimodalEditor.edit``.

        The arguments are EasyEdit's, in its order. Only ``prompts``, ``targets`` and
        ``image`` are required; a metric whose inputs are not given is left out of the
        result (not reported as zero). ``image`` / ``rephrase_image``: paths (relative to
        ``image_root``) or PIL images, one per prompt; ``file_type``: ``"image"`` (one or
        one per prompt; videos are not edited). ``locality_inputs``: ``{"text": {"prompt",
        "ground_truth"}, "vision": {"prompt", "ground_truth", "image"}}``, either or both.
        ``keep_original_weight`` is accepted as EasyEdit's editors accept it. Returns ``(metrics, session,
        None)``; ``metrics[i]["post"]`` holds ``rewrite_acc``, ``rephrase_acc``,
        ``rephrase_image_acc``, ``locality_acc`` and ``multimodal_locality_acc``;
        ``metrics[i]["pre"]`` the first three before the edit; ``metrics[i]["refused"]``
        and ``["refused_reason"]`` as :meth:`Editor.edit`'s.
        """
        _keep_original_weight(kwargs)
        prompts_l = _prompts(prompts, kwargs)
        n = len(prompts_l)
        targets_l = _as_list("targets", targets, n)
        images = _as_list("image", image, n)
        kinds = _as_list("file_type", file_type, None if isinstance(file_type, str) else n) or []
        for k in kinds:
            if k != "image":
                raise InputError(f"file_type {k!r}: dualedit edits with images ('image'); videos are not supported")
        rephrases = _as_list("rephrase_prompts", rephrase_prompts, n)
        rephrase_images = _as_list("rephrase_image", rephrase_image, n)
        text_loc = vision_loc = None
        if locality_inputs:
            unknown = set(locality_inputs) - {"text", "vision"}
            if unknown:
                raise InputError(f"locality_inputs: unknown keys {sorted(unknown)} (text, vision)")
            if "text" in locality_inputs:
                text_loc = _keyed("locality_inputs", {"text": locality_inputs["text"]}, n, ("prompt", "ground_truth"))[1]
            if "vision" in locality_inputs:
                vision_loc = _keyed("locality_inputs", {"vision": locality_inputs["vision"]}, n, ("prompt", "ground_truth", "image"))[1]
        records = []
        for i in range(n):
            r: Dict[str, Any] = {"src": prompts_l[i], "alt": targets_l[i], "image": images[i]}
            if rephrases is not None:
                r["rephrase"] = rephrases[i]
            if rephrase_images is not None:
                r["image_rephrase"] = rephrase_images[i]
            if text_loc is not None:
                r["loc"] = text_loc["prompt"][i]
                r["loc_ans"] = text_loc["ground_truth"][i]
            if vision_loc is not None:
                r["m_loc"] = vision_loc["image"][i]
                r["m_loc_q"] = vision_loc["prompt"][i]
                r["m_loc_a"] = vision_loc["ground_truth"][i]
            records.append(r)

        s = self.session
        pre = s.measure(records, image_root=image_root)
        if sequential_edit:
            t0 = time.perf_counter()
            report = s.edit(records, sequential=True, image_root=image_root)
            per = (time.perf_counter() - t0) / n
            posts = [(q, per) for q in report["requests"]]
        else:
            posts = []
            for r in records:
                t0 = time.perf_counter()
                report = s.edit([r], image_root=image_root)
                posts.append((report["requests"][0], time.perf_counter() - t0))
                s.reset()
        metrics = []
        for i, (before, (after, seconds)) in enumerate(zip(pre, posts)):
            m_pre = {"rewrite_acc": before["reliability"]}
            m_post = {"rewrite_acc": after["reliability"]}
            for name, key in (("rephrase_acc", "generalization"), ("rephrase_image_acc", "image_generalization")):
                if after.get(key) is not None:
                    m_pre[name] = before[key]
                    m_post[name] = after[key]
            if after.get("locality") is not None:
                m_post["locality_acc"] = after["locality"]
            if after.get("image_locality") is not None:
                m_post["multimodal_locality_acc"] = after["image_locality"]
            metrics.append({"case_id": i, "time": seconds, "pre": m_pre, "post": m_post,
                            "refused": after["refused"], "refused_reason": after["refused_reason"]})
            if verbose:
                print(f"{i} editing: {prompts_l[i]} -> {targets_l[i]}  {m_post}")
        return metrics, s, None
