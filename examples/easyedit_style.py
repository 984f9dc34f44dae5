"""An EasyEdit script on dualedit: the same `edit(...)` call and metrics, one import changed.

EasyEdit:
    from easyeditor import BaseEditor, MENDHyperParams
    editor = BaseEditor.from_hparams(MENDHyperParams.from_hparams("hparams/MEND/gpt2-xl"))
dualedit (a model folder and a trained editor folder; here the embedded default):
    import dualedit
    editor = dualedit.Editor("data/model", "data/editor")

Run from the repository root:  python examples/easyedit_style.py
"""

import json
from pathlib import Path

import dualedit

root = Path(__file__).resolve().parents[1] / "data"
editor = dualedit.Editor(root / "model", root / "editor")  # device="cuda", sub_device="cuda:1", ...

prompts = ["Vacorp was founded by", "Stonkresora is located on the continent of"]
target_new = ["Ledrerra", "Posora"]
ground_truth = ["Drekalkrin", "Ruasia"]
rephrase_prompts = ["The founder of Vacorp is", "Stonkresora is a country in"]
locality_inputs = {
    "neighborhood": {
        "prompt": ["The founder of Begremex is", "Rekbem works as a"],
        "ground_truth": ["Lesdektri", "farmer"],
    }
}

metrics, edited_model, _ = editor.edit(
    prompts=prompts,
    target_new=target_new,
    ground_truth=ground_truth,
    rephrase_prompts=rephrase_prompts,
    locality_inputs=locality_inputs,
    sequential_edit=True,  # keep both edits, measure after the last (False: each from the unedited model)
)
for m in metrics:
    print(json.dumps({"case_id": m["case_id"], "pre": m["pre"], "post": m["post"]}))

# The edited model is a dualedit.Session: ask it, score with it, save it, undo the edits.
for p in prompts:
    print(f"{p!r} -> {edited_model.generate(p, max_new_tokens=4)['text']!r}")
edited_model.reset()
