"""A copy of an evaluation data folder with every image replaced by a plain grey one of the same size: the
harness run on it scores the same questions without what the images show (the answer prior), beside the run
on the real images.

    python benchmarks/blank_images.py eval/data/synth576 /tmp/blank576
    mm-oval eval --model bundled-smol:runs/smol/parts --task vqav2 --data /tmp/blank576 --limit 80 --out runs/blank

Everything else (questions, annotations, file names) is copied as it is. The output folder must not exist
yet, so a copy is never mixed with an older one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from PIL import Image, UnidentifiedImageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
GREY = (128, 128, 128)


def blank_copy(src: Path, dst: Path) -> int:
    """Copy `src` to `dst` with every image blanked; returns the number of images blanked."""
    shutil.copytree(src, dst)
    n = 0
    for path in sorted(dst.rglob("*")):
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
            continue
        try:
            with Image.open(path) as im:
                size = im.size
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{src / path.relative_to(dst)} cannot be read as an image ({e})") from None
        Image.new("RGB", size, GREY).save(path)
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="an evaluation data folder (e.g. eval/data/synth576)")
    ap.add_argument("dst", type=Path, help="the copy to write (must not exist)")
    args = ap.parse_args()
    if not args.src.is_dir():
        ap.error(f"{args.src} is not a folder; pass an evaluation data folder")
    if args.dst.exists():
        ap.error(f"{args.dst} exists; pass a new folder (a blanked copy is never written over another)")
    try:
        n = blank_copy(args.src, args.dst)
    except ValueError as e:
        shutil.rmtree(args.dst, ignore_errors=True)
        print(f"blank_images: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {n} images blanked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
