"""The checks a GPU box runs on itself (scripts/gpu_check.sh): device and dtype, per-rank placement, the memory cap,
peak memory, out-of-memory classification, predicted vs measured memory and tokens/s at an 8B shape, FSDP2.

One step per process (`python -m gpu_check step NAME --out DIR`): a step that crashes, hangs
or fills the GPU takes nothing else down, and its JSON (DIR/NAME.json) is written when it starts, as it
progresses and when it ends. `finish NAME` (no torch import) then records a step its process left unfinished
(timed out, killed, crashed), rewrites DIR/summary.json and prints the step's one-line result.

Needs only torch and transformers (peft for the LoRA steps, accelerate for FSDP): a bare GPU box has no trl,
datasets, bitsandbytes or pydantic, so nothing here imports launcher.recipe, and the training loop is plain torch
doing what the worker's Trainer does (fused AdamW, gradient clipping, bf16 autocast, non-reentrant checkpointing).
`--dry-run` runs every step on the CPU with the CPU's expectations and a tiny model shape.

runner (the command line, the step order, results, summary and the closing report of what the call decides),
preflight (before the first step: the box's imports and card tried, what it cannot hold skipped, each step's
estimate), common (what every check shares); one module per check: tiny_model, device, placement_check (placement,
memory cap), memory_check (peak memory, oom), bench (predicted vs measured; training: the model and loop it times),
padding (padded vs padding-free), attention, generation, product (ftrun itself on the tiny model), resume_check,
vs_trl, loss_head, launch, fsdp_check, smoke_check, unsloth_check. A check whose name another ftrun module has
(memory, fsdp, placement, smoke, resume, unsloth) ends in `_check`.
May import plan/ (sizing, models, hardware, plan), the other worker/ modules and store/; never run/ or deliver/.
"""
