"""transformers' side of tests/slow/vledit.rs: what a Qwen2-VL folder gives in transformers.

    python scripts/vl_reference.py template DIR IMAGE TEXT TARGET
        The ids of `apply_chat_template([user: image, text], add_generation_prompt=True)
        + " " + TARGET` with IMAGE, from AutoProcessor.from_pretrained(DIR) (transformers
        finds the folder's template itself). Where torchvision is missing (transformers'
        Qwen2-VL video processor needs it, so AutoProcessor cannot be built), the same steps
        by hand: the tokenizer's apply_chat_template (transformers' Jinja2 setup) on the
        folder's chat_template.jinja, the one <|image_pad|> expanded to the image's
        merged-patch count, then tokenised, as Qwen2VLProcessor.__call__ does.

    python scripts/vl_reference.py logprobs DIR IMAGE TEXT
        The folder loaded with AutoModelForImageTextToText, AutoTokenizer and the Pillow
        Qwen2VLImageProcessor; the log-probability of each token of TEXT shown after IMAGE's
        run (<|vision_start|> + pads + <|vision_end|>), as `dualedit score --image` scores it.
        With torchvision, also the class AutoProcessor.from_pretrained(DIR) gives.

Prints one JSON object. Needs torch, transformers (5.23 tested), Pillow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def image_tokens(proc, image: str) -> tuple[dict, int]:
    out = proc(images=[Image.open(image)], return_tensors="pt")
    n = int(out["image_grid_thw"][0].prod()) // (proc.merge_size**2)
    return out, n


def auto_processor(d: str):
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(d)


def template(d: str, image: str, text: str, target: str) -> dict:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    auto = auto_processor(d)
    if auto is not None:
        prompt = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = auto(text=[prompt + " " + target], images=[Image.open(image)])["input_ids"][0]
        return {"prompt": prompt, "input_ids": list(ids), "via": type(auto).__name__}
    tok = AutoTokenizer.from_pretrained(d)
    proc = Qwen2VLImageProcessorPil.from_pretrained(d)
    chat_template = (Path(d) / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = tok.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True, tokenize=False)
    _, n = image_tokens(proc, image)
    full = (prompt + " " + target).replace("<|image_pad|>", "<|placeholder|>" * n).replace("<|placeholder|>", "<|image_pad|>")
    ids = tok(full)["input_ids"]
    return {"prompt": prompt, "input_ids": ids, "via": "by hand"}


def logprobs(d: str, image: str, text: str) -> dict:
    tok = AutoTokenizer.from_pretrained(d)
    proc = Qwen2VLImageProcessorPil.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    cfg = model.config
    img, n = image_tokens(proc, image)
    text_ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id] + text_ids
    t = torch.tensor([ids])
    with torch.no_grad():
        mm = (t == cfg.image_token_id).to(torch.int32)  # what the processor returns beside input_ids
        logits = model(input_ids=t, pixel_values=img["pixel_values"], image_grid_thw=img["image_grid_thw"], mm_token_type_ids=mm).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, t[0, 1:, None])[:, 0]
    auto = auto_processor(d)
    return {
        "input_ids": ids,
        "image_tokens": n,
        "logprobs": lp[-len(text_ids):].tolist(),
        "auto_processor": type(auto).__name__ if auto is not None else None,
    }


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    out = {"template": template, "logprobs": logprobs}[mode](*args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
