"""The :class:`Session`: one loaded model (and editor) that edits, scores, generates,
resets and saves, over the Rust library's ``Session``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import _native
from ._errors import InputError

PathLike = Union[str, "os.PathLike[str]"]

#: The keys of an E-VQA record that name images.
IMAGE_KEYS = ("image", "image_rephrase", "m_loc")


@dataclass
class Score:
    """Next-token log-probabilities of a text (after an image when one was given).

    ``logprobs[t]`` is ``log p(tokens[t + first] | before)`` where ``first`` is 1 without
    an image (the first token has nothing before it) and 0 with one. ``tensor`` holds the
    same numbers as a float64 ``torch.Tensor`` of shape ``[len(logprobs)]``.
    """

    tokens: List[int]
    logprobs: List[float]
    mean_nll: float
    image_tokens: int
    tensor: torch.Tensor = field(repr=False)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object of ``dualedit score --json``."""
        return {"tokens": self.tokens, "logprobs": self.logprobs, "mean_nll": self.mean_nll, "image_tokens": self.image_tokens}


def _path(p: Optional[PathLike]) -> Optional[str]:
    return None if p is None else os.fspath(p)


def _dtype(d: Any) -> Optional[str]:
    if d is None:
        return None
    if isinstance(d, torch.dtype):
        return str(d)
    return str(d)


def _extension_values(kw: Dict[str, Any]) -> Dict[str, Any]:
    """Python values as the extension reads them: paths as text, ``dtype`` and
    ``max_memory`` as the CLI writes them."""
    out = {}
    for k, v in kw.items():
        if k == "dtype":
            v = _dtype(v)
        elif k == "max_memory":
            v = _max_memory(v)
        elif isinstance(v, os.PathLike):
            v = os.fspath(v)
        out[k] = v
    return out


def _options(**kw: Any) -> str:
    """Keyword arguments as JSON for the extension, the ones given as ``None`` left out
    (the library's defaults apply). The library checks them, naming a keyword it does
    not know."""
    return json.dumps({k: v for k, v in _extension_values(kw).items() if v is not None})


def _max_memory(m: Any) -> Optional[str]:
    """``{"cuda:0": "24GiB", "cpu": 64 << 30}`` or the CLI's ``cuda:0=24GiB,...``."""
    if m is None:
        return None
    if isinstance(m, str):
        return m
    if isinstance(m, Mapping):
        return ",".join(f"{k}={v}" for k, v in m.items())
    raise InputError(f"max_memory must be a dict of device -> size or a string like 'cuda:0=24GiB', got {type(m).__name__}")


class _Images:
    """Images of image edit requests given as PIL images, written as PNG files into a
    private temporary folder for the Rust image preprocessor (removed on close)."""

    def __init__(self) -> None:
        self.dir: Optional[str] = None
        self.n = 0

    def path(self, image: Any, root: Optional[PathLike] = None) -> Any:
        """A path for the Rust side: a relative path under ``root`` when one is given (as an
        edit's images are under its ``image_root``), a PIL image written to a file."""
        if image is None:
            return image
        if isinstance(image, (str, os.PathLike)):
            p = os.fspath(image)
            return os.path.join(os.fspath(root), p) if root is not None and not os.path.isabs(p) else p
        if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image
            if self.dir is None:
                self.dir = tempfile.mkdtemp(prefix="dualedit-images-")
            self.n += 1
            p = os.path.join(self.dir, f"image-{self.n}.png")
            image.save(p, format="PNG")
            return p
        raise InputError(f"an image must be a path or a PIL image, got {type(image).__name__}")

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> "_Images":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _records(requests: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> List[Dict[str, Any]]:
    if isinstance(requests, Mapping):
        return [dict(requests)]
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise InputError("requests must be a dict or a list of dicts (EasyEdit records)")
    out = []
    for i, r in enumerate(requests):
        if not isinstance(r, Mapping):
            raise InputError(f"requests: record {i} must be a dict, got {type(r).__name__}")
        out.append(dict(r))
    if not out:
        raise InputError("no edit requests")
    return out


def _is_image_request(r: Mapping[str, Any]) -> bool:
    return "src" in r or "image" in r


class Session:
    """One loaded model (a Hugging Face folder) and, optionally, a trained MEND editor.

    Edits are committed into the weights, so later scores, generations and saves see them;
    :meth:`reset` puts back the exact tensors the model was loaded with.

    Args:
        model: the model folder (``config.json``, ``*.safetensors``, ``tokenizer.json``).
        editor: the trained editor folder (``dualedit train --out``); without one the
            session scores and generates, and :meth:`edit` refuses.
        device: the main device (``cpu``, ``cuda``, ``cuda:N``).
        sub_device: the device of the edited forwards (default: the main device).
        dtype: ``f32`` (default), ``bf16``, ``f16`` or a ``torch.dtype``.
        placement: ``replica`` (default), ``balanced`` or ``auto`` (the planner picks).
        max_memory: per-device caps, ``{"cuda:0": "24GiB"}`` or ``"cuda:0=24GiB"``.
        method: ``auto`` (the default with an editor, as ``dualedit edit`` and
            ``dualedit serve``: one request per call on an unedited session with
            ``mend``, several, or one after another, with ``mend-ls`` and the editor for
            many edits the editor's ``editor.json`` names), ``mend``, ``mend-ls``, ``ft``
            or ``unedited``.
        guard: the commit guard on the requests' locality prompts (on by default, as in
            ``dualedit edit``); ``guard_*`` keyword arguments as the CLI's flags.
        **options: ``optimizer_device``, ``ft_lr``, ``ls_lambda``, ``ls_keep_weight``,
            ``ls_rounds``, ``ls_keep_text``, ``max_length`` (512), ``guard_min_agreement``,
            ``guard_max_drop``, ``guard_max_kl``, ``guard_refuse``, ``guard_shrink``.

    Raises:
        NotFoundError: the model or editor folder does not exist.
        InputError, FileError, DeviceError: as ``dualedit edit`` reports them.
    """

    def __init__(
        self,
        model: PathLike,
        editor: Optional[PathLike] = None,
        device: str = "cpu",
        sub_device: Optional[str] = None,
        dtype: Any = None,
        placement: Optional[str] = None,
        max_memory: Any = None,
        method: Optional[str] = None,
        guard: bool = True,
        **options: Any,
    ) -> None:
        self._s = _native.Session(
            _options(
                model=model,
                editor=editor,
                device=device,
                sub_device=sub_device,
                dtype=dtype,
                placement=placement,
                max_memory=max_memory,
                method=method,
                guard=guard,
                **options,
            )
        )

    # -- editing ---------------------------------------------------------------------

    def edit(
        self,
        requests: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]],
        sequential: bool = False,
        method: Optional[str] = None,
        guard: Optional[bool] = None,
        stepwise: bool = False,
        image_root: Optional[PathLike] = None,
        rephrase_image_root: Optional[PathLike] = None,
    ) -> Dict[str, Any]:
        """Applies edit requests and commits them into the weights.

        Text requests are EasyEdit records (``dualedit edit --requests``' format):
        ``prompt``, ``target_new`` and optionally ``subject``, ``ground_truth``,
        ``rephrase_prompt``, ``locality_prompt``, ``locality_ground_truth``,
        ``portability``. Image requests (Qwen2-VL models) are E-VQA records: ``src``,
        ``alt``, ``image``, ``rephrase``, ``image_rephrase``, ``loc``, ``loc_ans``,
        ``m_loc``, ``m_loc_q``, ``m_loc_a``, whose images are paths (relative to
        ``image_root``, default the working folder) or PIL images.

        All requests form one batch edit, or with ``sequential`` are applied one after
        another. All or nothing: if anything fails, the weights are as before the call
        (edits the commit guard refuses are counted in the report's ``refused``; when it
        equals the number of requests, nothing was committed).
        ``method``: ``auto`` (as the session was opened), ``mend`` or ``mend-ls`` (which
        needs a session opened with ``auto`` and an editor for many edits, or ``mend-ls``).

        Returns:
            The edit's one result, as ``dualedit edit --json`` and ``serve``'s ``/edit``
            give it: ``method``, ``sequential``, the summary's means (``seconds_per_edit``
            among them), ``requests`` with each one's metrics, answers before and after
            and the guard's ``refused`` / ``refused_reason``, ``edits_total``, ``guard``,
            ``refused`` and ``conflicts`` (locality prompts naming a subject the call
            edits, contradictory requests); not the CLI's file-run fields (``data``,
            ``report``, ``saved``); plus ``seconds.edit`` (the library's edit call, the
            span the CLI's run report calls ``seconds.edit``).
        """
        if method is not None and method.replace("_", "-") not in ("auto", "mend", "mend-ls"):
            raise InputError(
                f"an edit's method is 'auto' (as the session was opened), 'mend' or 'mend-ls', not {method!r}; "
                f"open a Session with method={method!r} to edit with it"
            )
        records = _records(requests)
        kinds = {_is_image_request(r) for r in records}
        if len(kinds) > 1:
            raise InputError("requests mix text records (prompt/target_new) and image records (src/alt/image): edit them in separate calls")
        if kinds == {True}:
            with _Images() as images:
                for r in records:
                    for k in IMAGE_KEYS:
                        if k in r:
                            r[k] = images.path(r[k])
                out = self._s.edit_images(
                    json.dumps(records),
                    _path(image_root) or os.getcwd(),
                    _path(rephrase_image_root),
                    sequential=sequential,
                    guard=guard,
                )
        else:
            if image_root is not None or rephrase_image_root is not None:
                raise InputError("image_root is for image requests (E-VQA records), and these are text requests")
            out = self._s.edit(json.dumps(records), sequential=sequential, guard=guard, stepwise=stepwise, method=method)
        return json.loads(out)

    def measure(
        self,
        requests: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]],
        image_root: Optional[PathLike] = None,
    ) -> List[Dict[str, Any]]:
        """Each request's metrics on the current weights, without editing them (what
        EasyEdit reports as ``pre``): a list of per-request metrics dicts."""
        records = _records(requests)
        if all(_is_image_request(r) for r in records):
            with _Images() as images:
                for r in records:
                    for k in IMAGE_KEYS:
                        if k in r:
                            r[k] = images.path(r[k])
                return json.loads(self._s.measure_images(json.dumps(records), _path(image_root) or os.getcwd()))
        return json.loads(self._s.measure(json.dumps(records)))

    # -- reading the model -----------------------------------------------------------

    def score(self, text: str, image: Any = None, image_root: Optional[PathLike] = None) -> Score:
        """Next-token log-probabilities of ``text`` under the current (edited) weights,
        after ``image`` (a path or PIL image; Qwen2-VL models) when given. A relative path
        is under ``image_root`` (default the working folder), as in :meth:`edit`."""
        with _Images() as images:
            text_json, tensor = self._s.score(text, images.path(image, image_root))
        d = json.loads(text_json)
        return Score(tokens=d["tokens"], logprobs=d["logprobs"], mean_nll=d["mean_nll"], image_tokens=d["image_tokens"], tensor=tensor)

    def generate(self, prompt: str, max_new_tokens: int = 16, image: Any = None, image_root: Optional[PathLike] = None) -> Dict[str, Any]:
        """Greedy continuation of ``prompt`` (after ``image`` when given, a relative path
        under ``image_root`` as in :meth:`score`): a dict with ``text``, ``tokens``,
        ``prompt_tokens`` and ``finish_reason`` (``length``, ``eos`` or ``context``)."""
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        with _Images() as images:
            return json.loads(self._s.generate(prompt, max_new_tokens, images.path(image, image_root)))

    def answer(self, prompt: str, max_new_tokens: int = 16, image: Any = None, image_root: Optional[PathLike] = None) -> str:
        """The text of :meth:`generate`."""
        return self.generate(prompt, max_new_tokens, image, image_root)["text"]

    # -- state -----------------------------------------------------------------------

    def reset(self) -> int:
        """Puts back the exact weights the model was loaded with; returns how many
        parameters were restored."""
        return self._s.reset()

    def save(self, dir: PathLike) -> None:
        """Writes the current (edited) model to ``dir`` (which must not hold a model yet)
        as a Hugging Face folder that transformers and :class:`Session` load."""
        self._s.save(os.fspath(dir))

    def memory(self) -> List[Dict[str, Any]]:
        """Memory figures of each device the session uses (``role``, ``device``, bytes)."""
        return json.loads(self._s.memory())

    @property
    def edits_total(self) -> int:
        """Requests committed since the session was opened or last reset."""
        return self._s.edits_total

    @property
    def method(self) -> str:
        """``mend``, ``mend-ls``, ``ft``, ``unedited``, or ``none`` without an editor."""
        return self._s.method

    @property
    def model_dir(self) -> str:
        return os.fspath(self._s.model_dir)

    @property
    def editor_dir(self) -> Optional[str]:
        d = self._s.editor_dir
        return None if d is None else os.fspath(d)

    @property
    def max_positions(self) -> int:
        """The model's context: the longest token sequence it accepts."""
        return self._s.max_positions

    @property
    def devices(self) -> List[Tuple[str, str]]:
        """``(role, device)`` of each device the session uses."""
        return list(self._s.devices)

    def __repr__(self) -> str:
        return repr(self._s)
