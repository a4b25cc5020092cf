"""Whether `packing: true` keeps examples apart: the attention implementations that honour the boundaries of a
packed row, and the plan's decision (its reason line, or the refusal). TRL 1.16's "bfd" packing restarts the position
ids at each example (trl/data_utils.py pack_dataset, sft_trainer.py DataCollatorForLanguageModeling); transformers
5.24 reads them only without a KV cache (masking_utils.py _preprocess_mask_arguments). docs/data.md, "Packing";
tests/data/test_packing.py.
"""

from __future__ import annotations

from typing import Any, Optional

from launcher.errors import RecipeError

_BLOCK_DIAGONAL = (
    "a block-diagonal causal mask from the restarting position ids (transformers masking_utils.py "
    "find_packed_sequence_indices, create_causal_mask)"
)
# attention implementation -> how it keeps the examples of a packed row apart (None: it does not)
ATTENTION = {
    "sdpa": _BLOCK_DIAGONAL,
    "eager": _BLOCK_DIAGONAL,
    "flex_attention": "a block mask from the restarting position ids (transformers masking_utils.py)",
    "flash_attention_2": "variable-length kernels over the examples' boundaries (cu_seq_lens from the collator or the "
    "position ids: transformers modeling_flash_attention_utils.py _flash_attention_forward)",
    "flash_attention_3": "variable-length kernels, as flash_attention_2",
    "ftrun_varlen": "torch's FlashAttention-2 varlen kernel over the examples' boundaries (cu_seq_lens from TRL's "
    "collator: launcher/worker/varlen.py; checked on CPU with a per-example reference for the kernel, "
    "tests/worker/test_varlen.py)",
    "flash_attention_4": "variable-length kernels, as flash_attention_2",
}
UNMASKED = (
    "transformers builds no per-example mask for it (masking_utils.py _preprocess_mask_arguments exits "
    "early for implementations it does not know), so the examples of a packed row attend to each other"
)
# tests/data/test_packing.py compares each packed example's loss with its loss alone on CPU for these
VERIFIED_ON_CPU = ("sdpa", "eager")


def decision(recipe: Any, engine: str, attention: str) -> Optional[str]:
    """The plan's reason line for packing (None when the recipe does not pack); a RecipeError when the examples of
    a packed row would see each other."""
    if not recipe.packing:
        return None
    strategy = recipe.trainer.get("packing_strategy", "bfd")
    if strategy == "wrapped":
        raise RecipeError(
            "packing: true with trainer.packing_strategy 'wrapped' concatenates the examples and cuts the stream into "
            "rows without their boundaries (trl/data_utils.py pack_dataset): position ids do not restart and every "
            "example attends to the one before it, so its loss is not its loss alone",
            fix="remove trainer.packing_strategy (TRL's default 'bfd' keeps the boundaries), or set packing: false.",
        )
    if recipe.trainer.get("use_cache"):
        raise RecipeError(
            "packing: true with trainer.use_cache true: with a KV cache in the forward, transformers ignores the "
            "restarting position ids (masking_utils.py _preprocess_mask_arguments) and the examples of a packed row "
            "attend to each other",
            fix="remove trainer.use_cache (training needs no cache), or set packing: false.",
        )
    if engine == "unsloth":
        return (
            "packing: Unsloth's own packing keeps the examples apart (unsloth/utils/packing.py: block-diagonal "
            "masks and varlen lengths from the packed sequence lengths); not run by ftrun's CPU test"
        )
    how = ATTENTION.get(attention)
    if how is None:
        raise RecipeError(
            f"packing: true on attention '{attention}': {UNMASKED}",
            fix="set packing: false (padding_free keeps most of the speed without mixing examples), or "
            f"use one of: {', '.join(ATTENTION)}.",
        )
    checked = " (checked on CPU: tests/data/test_packing.py)" if attention in VERIFIED_ON_CPU else ""
    return (
        f"packing: rows of max_length {recipe.max_length} hold several examples; each attends only to itself "
        f"with {attention}: {how}{checked}"
    )
