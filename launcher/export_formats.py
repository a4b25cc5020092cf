"""The export formats as a table: one row a format (adapter, merged, gguf), in the order the export makes them, with
what each needs made first. A root leaf: the recipe, run/ and deliver/ ask it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExportFormat:
    name: str
    needs: tuple[str, ...]  # formats made (and checked) first, whether asked for or not
    what: str  # what it is, for the recipe's help ("" where the name says it)


FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (
        ExportFormat("adapter", (), ""),
        ExportFormat("merged", (), "16-bit, for vLLM"),
        # llama.cpp's converter reads a 16-bit model folder (launcher/deliver/gguf_export.py)
        ExportFormat("gguf", ("merged",), "for Ollama/llama.cpp; implies merged"),
    )
}


def described() -> str:
    return ", ".join(f"{f.name} ({f.what})" if f.what else f.name for f in FORMATS.values())


def made(formats) -> tuple[str, ...]:
    """The formats an export of `formats` makes, with what they need, in the order it makes them."""
    wanted = set(formats)
    for name in list(wanted):
        wanted.update(FORMATS[name].needs)
    return tuple(f for f in FORMATS if f in wanted)
