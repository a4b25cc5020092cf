"""A vision-language model's processor (image processor, tokenizer, chat template) as training, the task evaluation
and the export load it.

transformers' `AutoProcessor` builds every sub-processor the processor class names. Qwen2-VL, Qwen2.5-VL and Qwen3-VL
name a video processor, which transformers 5.24 only has as a torchvision class (models/auto/video_processing_auto.py
maps qwen2_5_vl to {"torchvision": "Qwen2VLVideoProcessor"} alone); without torchvision (this project's CPU machines:
its PyPI wheels are built for CUDA torch) the processor cannot be built at all, image-only data included. Images have
a PIL backend (image_processing_auto.py: {"torchvision": ..., "pil": "Qwen2VLImageProcessorPil"}), so where
torchvision is missing the same processor class is built without its video processor, and the fallback is said once.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

VIDEO_ATTRIBUTE = "video_processor"


def processor_class_name(model_dir: Path) -> Optional[str]:
    """The processor class a model folder names (processor_config.json, else preprocessor_config.json), or None."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            cls = json.loads(path.read_text()).get("processor_class")
            if cls:
                return str(cls)
    return None


def _without_video(cls):
    """`cls` accepting no video processor: ProcessorMixin checks every sub-processor's class
    (processing_utils.py check_argument_for_proper_class), and a None video processor has none."""

    class WithoutVideo(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == VIDEO_ATTRIBUTE:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    WithoutVideo.__name__ = cls.__name__  # what TRL and the logs name
    WithoutVideo.__qualname__ = cls.__qualname__
    return WithoutVideo


def load_processor(model_dir, say=print):
    """The processor of a local vision-language model folder: AutoProcessor where it can build it, else (no
    torchvision) the same class without its video processor, said once through `say`."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    model_dir = Path(model_dir)
    cls_name = processor_class_name(model_dir)
    cls = getattr(transformers, cls_name, None) if cls_name else None
    needs_video = cls is not None and VIDEO_ATTRIBUTE in cls.get_attributes()
    if not needs_video or importlib.util.find_spec("torchvision") is not None:
        return AutoProcessor.from_pretrained(model_dir)
    say(
        f"processor: {cls_name} built without its video processor (transformers has it only for torchvision, "
        "which is not installed here); images are processed by its PIL image processor, videos are not supported"
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    return _without_video(cls)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=_chat_template(model_dir, tokenizer),
    )


def _chat_template(model_dir: Path, tokenizer: Any) -> Optional[str]:
    """The processor's chat template: chat_template.jinja (transformers 5 saves it so), else the tokenizer's."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    return getattr(tokenizer, "chat_template", None)
