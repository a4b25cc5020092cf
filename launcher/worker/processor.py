"""A vision-language model's processor (image processor, tokenizer, chat template) as training, the task evaluation
and the export load it. Qwen-VL processors name a video processor that transformers 5.24 has only for torchvision
(models/auto/video_processing_auto.py); without torchvision (CUDA-only wheels) the same class is built without it,
images through the PIL backend (image_processing_auto.py), and the fallback is said once.
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
    """`cls` accepting no video processor (processing_utils.py check_argument_for_proper_class)."""

    class WithoutVideo(cls):
        source_dir: Optional[Path] = None  # the model folder it was built from (load_processor)

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == VIDEO_ATTRIBUTE:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, *args, **kwargs):
            """The model folder's processor files, as they are: ProcessorMixin's would fail on the missing video
            processor, and the Trainer calls it at every checkpoint."""
            save_processor_files(self.source_dir, save_directory)
            return []

    WithoutVideo.__name__, WithoutVideo.__qualname__ = cls.__name__, cls.__qualname__  # what TRL and the logs name
    return WithoutVideo


def load_processor(model_dir, say=print):
    """The processor of a vision-language model folder: AutoProcessor, else (no torchvision) without its video
    processor, said through `say`."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from launcher.data.tokenizer import tokenizer_dir

    model_dir = tokenizer_dir(str(model_dir))[0] or Path(model_dir)  # a Hub id: its folder in the cache
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
    processor = _without_video(cls)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=_chat_template(model_dir, tokenizer),
    )
    processor.source_dir = model_dir
    return processor


def _chat_template(model_dir: Path, tokenizer: Any) -> Optional[str]:
    """The processor's chat template: chat_template.jinja (transformers 5 saves it so), else the tokenizer's."""
    path = model_dir / "chat_template.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else getattr(tokenizer, "chat_template", None)


def text_tokenizer(tokenizer_or_processor: Any) -> Any:
    """The tokenizer itself: a processor's (`.tokenizer`), or the argument where it is a tokenizer."""
    from transformers import ProcessorMixin

    return (
        tokenizer_or_processor.tokenizer
        if isinstance(tokenizer_or_processor, ProcessorMixin)
        else tokenizer_or_processor
    )


def encode(tokenizer_or_processor: Any, texts: list[str], images: Optional[list[list[str]]], **kwargs: Any) -> Any:
    """Rendered prompts as model inputs: with `images` (each text's files, in placeholder order) through the processor
    as trl 1.16 DataCollatorForVisionLanguageModeling calls it, read with load_image; else the tokenizer alone."""
    if not images or not any(images):
        return text_tokenizer(tokenizer_or_processor)(texts, **kwargs)
    from transformers.image_utils import load_image

    return tokenizer_or_processor(text=texts, images=[[load_image(p) for p in row] for row in images], **kwargs)


# The processor's files as the model folder has them: what a server loads beside the adapter or the merged weights.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "video_preprocessor_config.json",
)


def save_processor_files(model_dir, dest) -> None:
    """The model folder's processor files copied into `dest`, as they are (no video processor needed)."""
    import shutil

    from launcher.data.tokenizer import tokenizer_dir

    model_dir = tokenizer_dir(str(model_dir))[0] or Path(model_dir)  # a Hub id: its folder in the cache
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROCESSOR_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, dest / name)
