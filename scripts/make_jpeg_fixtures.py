#!/usr/bin/env python3
"""tests/fixtures/jpeg/: JPEGs of every kind a user's photos come in, and Pillow's pixels for each.

  pip install --target /tmp/pyjpeg pillow imagecodecs numpy
  PYTHONPATH=/tmp/pyjpeg .venv/bin/python scripts/make_jpeg_fixtures.py

Written by Pillow: baseline and progressive at 4:4:4, 4:2:2 and 4:2:0, greyscale (both), CMYK
(Adobe, inverted, as Photoshop writes it), restart markers, optimised Huffman tables, quality 5
and 100, an EXIF block with an orientation, odd sizes down to 1 x 1 and one taller than wide.
Written by imagecodecs' libjpeg-turbo (what Pillow cannot write): 4:1:1, 4:4:0, YCCK and RGB
stored without the YCbCr transform. The reference for each `NAME.jpg` is `pillow/NAME.png`:
`Image.open(NAME.jpg).convert("RGB")`, what transformers' image processors start from, saved
losslessly. manifest.json lists each file with Pillow's mode and size and the versions used.
"""
import io
import json
import sys
from pathlib import Path

import imagecodecs
import numpy as np
import PIL
from PIL import Image, features

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "jpeg"


def field(h, w, c, seed):
    """Smooth colour ramps with hard edges and some noise: chroma that upsampling must interpolate,
    edges that ring, saturated corners that clip."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    chans = []
    for i in range(c):
        v = 127.5 + 100 * np.sin(x / (3.0 + i) + y / (5.0 + 2 * i) + i)
        v += np.where((x // 7 + y // 5 + i) % 3 == 0, 60, -30)
        v += rng.normal(0, 18, (h, w))
        chans.append(v)
    a = np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)
    return a if c > 1 else a[..., 0]


def pillow_jpegs():
    rgb = Image.fromarray(field(45, 61, 3, 1), "RGB")
    out = {}
    for sub, name in [(0, "444"), (1, "422"), (2, "420")]:
        out[f"baseline_{name}.jpg"] = (rgb, dict(quality=85, subsampling=sub))
        out[f"progressive_{name}.jpg"] = (rgb, dict(quality=85, subsampling=sub, progressive=True))
    grey = Image.fromarray(field(33, 50, 1, 2), "L")
    out["grey.jpg"] = (grey, dict(quality=90))
    out["grey_progressive.jpg"] = (grey, dict(quality=90, progressive=True))
    out["cmyk.jpg"] = (Image.fromarray(field(30, 43, 4, 3), "CMYK"), dict(quality=90))
    out["restart_markers.jpg"] = (rgb, dict(quality=85, subsampling=2, restart_marker_blocks=3))
    out["restart_rows_progressive.jpg"] = (rgb, dict(quality=85, subsampling=2, restart_marker_rows=1, progressive=True))
    out["optimized.jpg"] = (rgb, dict(quality=85, optimize=True))
    out["quality_5.jpg"] = (rgb, dict(quality=5))
    out["quality_100.jpg"] = (rgb, dict(quality=100, subsampling=0))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 (the processor does not apply it)
    exif[0x010F] = "dualedit fixtures"
    out["exif.jpg"] = (rgb, dict(quality=85, exif=exif.tobytes()))
    out["one_pixel.jpg"] = (Image.fromarray(field(1, 1, 3, 4), "RGB"), dict(quality=85))
    out["odd_17x3.jpg"] = (Image.fromarray(field(3, 17, 3, 5), "RGB"), dict(quality=85, subsampling=2))
    out["tall_9x131.jpg"] = (Image.fromarray(field(131, 9, 3, 6), "RGB"), dict(quality=85, subsampling=2, progressive=True))
    res = {}
    for name, (img, kw) in out.items():
        buf = io.BytesIO()
        img.save(buf, format="JPEG", **kw)
        res[name] = (buf.getvalue(), f"Pillow {kw}")
    return res


def imagecodecs_jpegs():
    rgb = field(45, 61, 3, 7)
    res = {}
    for sub in ["411", "440"]:
        res[f"subsampling_{sub}.jpg"] = (imagecodecs.jpeg8_encode(rgb, level=85, subsampling=sub), f"imagecodecs subsampling={sub}")
    res["rgb_stored.jpg"] = (imagecodecs.jpeg8_encode(rgb, level=85, outcolorspace="RGB"), "imagecodecs outcolorspace=RGB")
    cmyk = field(30, 43, 4, 8)
    res["ycck.jpg"] = (imagecodecs.jpeg8_encode(cmyk, level=90, colorspace="CMYK", outcolorspace="YCCK"), "imagecodecs CMYK -> YCCK")
    return res


def main():
    (OUT / "pillow").mkdir(parents=True, exist_ok=True)
    files = {**pillow_jpegs(), **imagecodecs_jpegs()}
    manifest = {"pillow": PIL.__version__, "libjpeg_turbo": features.version("libjpeg_turbo"),
                "imagecodecs": imagecodecs.__version__, "numpy": np.__version__, "files": {}}
    for name, (data, how) in sorted(files.items()):
        (OUT / name).write_bytes(data)
        with Image.open(OUT / name) as im:
            mode, size = im.mode, im.size
            info = {k: im.info[k] for k in ("progressive", "progression", "adobe", "adobe_transform") if k in im.info}
            pixels = im.convert("RGB")
        pixels.save(OUT / "pillow" / (name[:-4] + ".png"))
        manifest["files"][name] = {"written_by": how, "mode": mode, "width": size[0], "height": size[1],
                                   "info": {k: (v if isinstance(v, (int, str)) else str(v)) for k, v in info.items()}}
        print(f"{name}: {mode} {size[0]}x{size[1]} {info}", file=sys.stderr)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
