#!/usr/bin/env python3
"""Write the tiny vision data set: small PNGs of one coloured square on a grey ground, and a chat JSONL asking its
colour ("What colour is the square?" -> "red."), images as {"type": "image", "image": PATH} parts with paths relative
to the JSONL. Sizes vary (56 to 112 pixels a side), so the image token counts differ per example."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "recipes" / "data" / "tiny-vision.jsonl"
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}
QUESTIONS = ("What colour is the square?", "Which colour is the square?", "Name the colour of the square.")
SIDES = (56, 84, 112)


def write_image(path: Path, colour: tuple[int, int, int], width: int, height: int, rng: random.Random) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (128, 128, 128))
    side = rng.randint(min(width, height) // 2, min(width, height) - 4)
    x, y = rng.randint(0, width - side), rng.randint(0, height - side)
    ImageDraw.Draw(img).rectangle([x, y, x + side - 1, y + side - 1], fill=colour)
    img.save(path, format="PNG", optimize=True)


def make(out: Path, n: int = 160, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder = out.with_suffix("")  # recipes/data/tiny-vision/
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        name = list(COLOURS)[i % len(COLOURS)]
        image = folder / f"{i:04d}.png"
        write_image(image, COLOURS[name], rng.choice(SIDES), rng.choice(SIDES), rng)
        rel = f"{folder.name}/{image.name}"
        user = [{"type": "image", "image": rel}, {"type": "text", "text": rng.choice(QUESTIONS)}]
        lines.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"{name}."}]})
    out.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("-n", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote {make(Path(a.out), a.n, a.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
