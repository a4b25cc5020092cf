"""The plan's vision-tower activations (launcher/plan/vision.py activation_bytes) against what the tower really keeps:
a Qwen2.5-VL tower of transformers 5.24 at the 7B's head size and ratios (head_dim 80, intermediate 2.67 x hidden),
a quarter of its width, run on the CPU in bf16 under autocast. What autograd saves is counted with saved-tensor hooks
(as tests/plan/test_sizing_activations.py does for a decoder layer), what stays allocated after a checkpointed forward
with torch's profiler (profile_memory); both per patch, as the slope over two image sizes."""

from __future__ import annotations

import pytest
import torch

from launcher.plan import vision
from launcher.plan.models import from_config
from launcher.plan.sizing_constants import LAYER_BACKWARD_FACTOR

H, I, HEADS, DEPTH = 320, 855, 4, 4
HEAD_DIM = H // HEADS
GRIDS = ((1, 16, 16), (1, 16, 32))  # 256 and 512 patches: 8 x 8-patch windows and one full-attention block
# The rotary tables (cos and sin, head_dim fp32 values each a patch) are computed once and shared by every block: the
# plan leaves them out (640 B a patch, 0.7% of what the 7B's checkpointed tower keeps); the count here does too.
ROTARY = 2 * HEAD_DIM * 4

VISION = {"depth": DEPTH, "hidden_size": H, "intermediate_size": I, "num_heads": HEADS, "out_hidden_size": 256}
VISION["fullatt_block_indexes"] = [DEPTH - 1]


def _arch():
    cfg = {**vision.QWEN25_VL_7B, "vision_config": {**vision.QWEN25_VL_7B["vision_config"], **VISION}}
    return from_config(cfg, "tiny-tower", "test")


def _tower(lora: bool):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=VISION).vision_config
    config._attn_implementation = "sdpa"
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).to(torch.bfloat16)
    tower.requires_grad_(False)
    tower.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        holder = torch.nn.Module()
        holder.tower = tower
        linears = [n for n, m in holder.named_modules() if isinstance(m, torch.nn.Linear)]  # as vision_targets picks
        get_peft_model(holder, LoraConfig(r=8, target_modules=linears, lora_dropout=0.0))
    return tower


def _pixels(grid):
    t, h, w = grid
    return torch.randn(t * h * w, 3 * 2 * 14 * 14, dtype=torch.bfloat16), torch.tensor([grid])


def _saved_per_patch(run) -> float:
    """Bytes autograd saves per patch in `run(grid)` (parameters and the rotary tables left out)."""
    sizes = []
    for grid in GRIDS:
        tower, args = run(grid)
        skip = {p.data_ptr() for p in tower.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            shared = t.dtype == torch.float32 and t.shape[-1:] == (HEAD_DIM,) and t.numel() == args[0] * HEAD_DIM
            if t.data_ptr() not in skip and not shared:
                saved.setdefault(t.data_ptr(), t.numel() * t.element_size())
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            args[1]()
        sizes.append((args[0], sum(saved.values())))
    (n0, b0), (n1, b1) = sizes
    return (b1 - b0) / (n1 - n0)


def _whole_tower(lora: bool):
    tower = _tower(lora)

    def run(grid):
        pixels, thw = _pixels(grid)
        return tower, (pixels.shape[0], lambda: tower(pixels, grid_thw=thw))

    return run


def _one_block(grid):
    """The recomputed block of the backward: one frozen block whose input requires a gradient."""
    tower = _tower(False)
    n = grid[0] * grid[1] * grid[2]
    x = torch.randn(n, H, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.arange(0, n + 1, 64, dtype=torch.int32)
    angles = torch.randn(n, HEAD_DIM)
    block = tower.blocks[0]
    return tower, (n, lambda: block(x, cu_seqlens=cu, position_embeddings=(angles.cos(), angles.sin())))


def _kept_after_checkpointed_forward(grid) -> tuple[int, int]:
    """(patches, bytes still allocated after the forward, the merged output left out); nothing from an earlier run may
    be freed inside the profiled span, so each run has its own frame."""
    from torch.profiler import ProfilerActivity, profile

    tower = _tower(False)
    tower.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    tower.enable_input_require_grads()
    pixels, thw = _pixels(grid)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p,
    ):
        merged = tower(pixels, grid_thw=thw).pooler_output
    live = sum(e.self_cpu_memory_usage for e in p.key_averages())
    return pixels.shape[0], live - merged.numel() * merged.element_size()


def test_a_trained_tower_without_checkpointing_keeps_what_the_plan_counts():
    """LoRA on every linear layer of the tower and the merger (lora.vision_tower with all-linear), no checkpointing:
    every block's tensors and the merger's, as autograd saves them."""
    measured = _saved_per_patch(_whole_tower(lora=True))
    assert vision.activation_bytes(_arch(), 1, False, True) == pytest.approx(measured, rel=0.03)


def test_a_checkpointed_frozen_tower_keeps_what_the_plan_counts():
    """The frozen tower under gradient checkpointing with its patch embedding hooked (enable_input_require_grads, as
    launcher/worker/loading.py add_lora and trl's SFTTrainer call it; non-reentrant, as the worker's trainer runs it):
    what stays allocated after the forward (each block's input, the hooked patch embedding's output, the merger's
    saved tensors) plus LAYER_BACKWARD_FACTOR x what the block recomputed in the backward saves."""
    kept = [_kept_after_checkpointed_forward(grid) for grid in GRIDS]
    (n0, b0), (n1, b1) = kept
    kept_per_patch = (b1 - b0) / (n1 - n0) - ROTARY
    block = _saved_per_patch(_one_block)
    measured = kept_per_patch + LAYER_BACKWARD_FACTOR * block
    assert vision.activation_bytes(_arch(), 1, True, False) == pytest.approx(measured, rel=0.03)
    # what the plan counted before the merger and the hooked patch embedding: 12% short at this depth
    assert DEPTH * H * 2 + LAYER_BACKWARD_FACTOR * block < 0.9 * measured
