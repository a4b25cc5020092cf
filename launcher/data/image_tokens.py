"""How many tokens an image becomes: the model's image processor's own rule, applied to the image's real size,
without importing transformers' image processors (they import torch: about 8 s here, and `ftrun plan` stays light).

The rule is transformers 5.24's, models/qwen2_vl/image_processing_pil_qwen2_vl.py (`smart_resize`,
`get_number_of_image_patches`): resized to multiples of patch_size x merge_size within [min_pixels, max_pixels],
cut into patches, every merge_size x merge_size of them one placeholder (processing_qwen2_5_vl.py). Checked against
the installed processor's `_get_num_multimodal_tokens` (tests/data/test_image_tokens.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launcher.errors import DataError

# The image processors whose rule this module knows (their preprocessor_config.json image_processor_type).
QWEN2_VL_FAMILY = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")


@dataclass(frozen=True)
class ImageRule:
    processor: str  # image_processor_type
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    source: str  # the file it was read from

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the processor's resize (transformers' smart_resize, same arithmetic)."""
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
        f = self.factor
        h_bar = round(height / f) * f
        w_bar = round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return w_bar, h_bar

    def tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of one image of this size."""
        w, h = self.resized(width, height)
        return (w // self.patch_size) * (h // self.patch_size) // (self.merge_size**2)

    def patches(self, width: int, height: int) -> int:
        """Patches the vision tower runs on (before the merge): what its activations scale with."""
        w, h = self.resized(width, height)
        return (w // self.patch_size) * (h // self.patch_size)

    def describe(self) -> str:
        return (
            f"{self.processor}: patch {self.patch_size}, merge {self.merge_size}, "
            f"{self.min_pixels:,} to {self.max_pixels:,} pixels ({self.source})"
        )


def read_rule(model_dir: Path) -> Optional[ImageRule]:
    """The image rule of a local model folder (None without one; a DataError for a processor not known here)."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    kind = str(cfg.get("image_processor_type", ""))
    if kind not in QWEN2_VL_FAMILY:
        raise DataError(
            f"{path} names the image processor {kind or '(none)'}, whose image-token rule ftrun does not know yet",
            fix=f"train a model with one of: {', '.join(QWEN2_VL_FAMILY)} (Qwen2-VL, Qwen2.5-VL), or add its rule "
            "to launcher/data/image_tokens.py.",
        )
    size = cfg.get("size") or {}
    return ImageRule(
        processor=kind,
        patch_size=int(cfg.get("patch_size", 14)),
        merge_size=int(cfg.get("merge_size", 2)),
        # transformers 5 keeps the bounds as size.shortest_edge/longest_edge; older files as min/max_pixels
        min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        source=str(path),
    )
