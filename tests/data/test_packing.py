"""Packing keeps examples apart: each packed example's loss through the real model equals its loss alone (position
ids restart, attention does not cross examples), on the attention implementations the plan can choose on CPU; a row
whose attention crosses examples is shown to differ; the plan refuses packing where it cannot hold."""

import pytest

from launcher.plan import packing
from launcher.errors import RecipeError

# float32 on CPU: the same examples through the same weights differ only by the order of additions in the wider
# matrix products of the packed row (measured below 1e-6); a crossing of attention moves the loss by far more.
TOLERANCE = 1e-5


def _examples(tiny_model):
    from launcher.data.dataset import load_data
    from launcher.data.loss_view import LossView, Settings
    from conftest import TINY_DATA

    view = LossView(str(tiny_model), Settings(max_length=512, packing=True))
    marked = [view.mark(e) for e in load_data(TINY_DATA).examples[:4]]
    # the labels as TRL builds them: the token where trained (the first of an example is masked by the collator)
    return [
        {"input_ids": m.ids, "labels": [t if tr or i == 0 else -100 for i, (t, tr) in enumerate(zip(m.ids, m.trained))]}
        for m in marked
    ]


def _per_example_losses(model, batch, bounds):
    import torch

    with torch.no_grad():  # as TRL's compute_loss calls it: use_cache=False (trl/trainer/sft_trainer.py)
        logits = model(
            **{k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask", "use_cache")},
            **({} if "use_cache" in batch else {"use_cache": False}),
        ).logits
    losses = torch.nn.functional.cross_entropy(
        logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100, reduction="none"
    )
    labels = batch["labels"][0, 1:]
    out = []
    for a, b in bounds:  # token positions [a, b) of each example; the predictions of positions a..b-1 sit at a-1..b-2
        sel = slice(max(a - 1, 0), b - 1)
        n = (labels[sel] != -100).sum()
        out.append(float(losses[sel].sum() / n))
    return out


@pytest.fixture(scope="module")
def packed(tiny_model):
    from datasets import Dataset
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = _examples(tiny_model)
    total = sum(len(r["input_ids"]) for r in rows)
    pack = pack_dataset(Dataset.from_list(rows), seq_length=total, strategy="bfd")  # TRL's packing: one row
    assert len(pack) == 1
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    row = pack[0]
    batch = collator([row])
    bounds, start = [], 0
    for n in row["seq_lengths"]:
        bounds.append((start, start + n))
        start += n
    order = [next(i for i, r in enumerate(rows) if r["input_ids"] == row["input_ids"][a:b]) for a, b in bounds]
    alone = [collator([rows[i]]) for i in order]
    return batch, bounds, alone


@pytest.mark.parametrize("attention", packing.VERIFIED_ON_CPU)
def test_each_packed_example_has_its_loss_alone(tiny_model, packed, attention):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation=attention, dtype=torch.float32)
    model.eval()
    batch, bounds, alone = packed
    assert batch["position_ids"][0].tolist().count(0) == len(bounds)  # the position ids restart at each example
    together = _per_example_losses(model, batch, bounds)
    apart = [_per_example_losses(model, a, [(0, a["input_ids"].shape[1])])[0] for a in alone]
    assert len(together) == len(bounds) >= 3
    for t, a in zip(together, apart):
        assert abs(t - a) < TOLERANCE, (attention, together, apart)

    # crossing attention changes every example after the first: the position ids of one long sequence; an attention
    # mask over the whole row (what an implementation without per-example masking does); a forward with a KV cache
    # (transformers' masking_utils reads the position ids only without one: TRL passes use_cache=False and the
    # Trainer sets config.use_cache from TrainingArguments.use_cache, False)
    crossing = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    unmasked = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    cached = {**batch, "use_cache": True}
    for broken in (crossing, unmasked, cached):
        wrong = _per_example_losses(model, broken, bounds)
        assert abs(wrong[0] - apart[0]) < TOLERANCE  # the first example sees nothing before it either way
        assert all(abs(w - a) > 100 * TOLERANCE for w, a in zip(wrong[1:], apart[1:])), (wrong, apart)


class _Recipe:
    def __init__(self, packing=True, **trainer):
        self.packing, self.trainer, self.max_length = packing, trainer, 512


def test_the_plan_states_or_refuses_packing():
    assert packing.decision(_Recipe(packing=False), "trl", "sdpa") is None
    assert "block-diagonal" in packing.decision(_Recipe(), "trl", "sdpa")
    assert "variable-length" in packing.decision(_Recipe(), "ddp", "flash_attention_2")
    with pytest.raises(RecipeError, match="attend to each other"):
        packing.decision(_Recipe(), "trl", "kernels-community/some-attention")
    with pytest.raises(RecipeError, match="KV cache"):
        packing.decision(_Recipe(use_cache=True), "trl", "sdpa")
    with pytest.raises(RecipeError, match="'wrapped'"):
        packing.decision(_Recipe(packing_strategy="wrapped"), "trl", "sdpa")
    for attention in packing.VERIFIED_ON_CPU:
        assert attention in packing.ATTENTION
