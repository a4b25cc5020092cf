"""Long inputs (issue 59): plain text longer than max_length, whose refusal offers packing with splitting and whose plan
says how many tokens training keeps; max_length beyond the model's max_position_embeddings, refused, or stated where
the config's RoPE scaling extends it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import ftrun


def _documents(path: Path, n: int = 20, words: int = 120) -> Path:
    """Plain text documents, every one longer than a max_length of 64 tokens."""
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(f"Document {i} says word {k} of {words}." for k in range(words))}) + "\n"
            for i in range(n)
        )
    )
    return path


def test_long_text_is_refused_with_packing_that_keeps_every_token(write_recipe, tmp_path):
    """The refusal offered a higher max_length or cuts, both keeping each document's start alone; it now offers
    TRL's packing with splitting, with the tokens kept now and then, and the plan of that recipe says it keeps all."""
    from launcher.data.stats import data_stats
    from launcher.errors import DataError
    from launcher.recipe_loading import load_recipe
    from launcher.run.data_view import data_line

    data = _documents(tmp_path / "docs.jsonl")
    with pytest.raises(DataError) as err:
        data_stats(load_recipe(write_recipe(data=str(data), max_length=64)))
    text, fix = str(err.value), err.value.fix
    assert "max_length 64 cuts 20 of 20 documents" in text and "each long document's start alone" in text
    kept = int(text.split("training would keep ")[1].split(" of")[0].replace(",", ""))
    total = int(text.split("of the data's ")[1].split(" tokens")[0].replace(",", ""))
    assert kept == 20 * 64 and total > 10 * kept
    assert fix.startswith("pack with splitting: packing: true and trainer: {packing_strategy: bfd_split}")
    assert f"all {total:,} tokens train" in fix
    # the recipe the fix names: planned, every token kept, and said so
    packed = load_recipe(
        write_recipe(data=str(data), max_length=64, packing=True, trainer={"packing_strategy": "bfd_split"})
    )
    stats = data_stats(packed)[2]
    assert stats.total_tokens == stats.all_tokens == total
    assert f"20 over max_length 64: packing splits them into pieces, all {total:,} tokens kept" in data_line(stats)
    # plain text ends with the EOS TRL appends, which the data view names (not the chat template's end of turn)
    from launcher.data.tokenizer import read_tokenizer

    assert stats.loss_view["end_of_turn"] == read_tokenizer(Path(packed.model)).special["eos_token"] != "<|im_end|>"
    # TRL's default packing (bfd) cuts each document as plain truncation does: refused the same way
    with pytest.raises(DataError, match="cuts 20 of 20 documents"):
        data_stats(load_recipe(write_recipe(data=str(data), max_length=64, packing=True)))
    # cuts allowed: the data line says how many tokens are kept of all
    cut = data_stats(load_recipe(write_recipe(data=str(data), max_length=64, max_length_may_cut=1.0)))[2]
    assert f"20 over max_length 64: truncated, {kept:,} of {total:,} tokens kept" in data_line(cut)


def _model(tmp_path: Path, tiny_model: Path, **config) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_max_length_beyond_the_models_positions_is_refused(tmp_path, tiny_model):
    from conftest import recipe_file

    recipe = recipe_file(tmp_path / "r.yaml", tiny_model, tmp_path / "run", max_length=6500)  # positions: 4,096
    res = ftrun("plan", recipe, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "max_length 6,500 is beyond" in res.stderr and "max_position_embeddings 4,096" in res.stderr
    assert "no RoPE scaling" in res.stderr and "Fix: set max_length: 4096 or less" in res.stderr
    assert "Traceback" not in res.stderr


def test_rope_scaling_is_named_where_it_reaches_max_length(tmp_path, tiny_model):
    from launcher.errors import RecipeError
    from launcher.plan.hardware import from_spec
    from launcher.plan.models import load_architecture
    from launcher.plan.plan import plan_for
    from launcher.recipe_loading import validate_recipe

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 1e6}
    model = _model(tmp_path, tiny_model, rope_parameters=yarn)
    arch = load_architecture(str(model))
    assert arch.max_positions == 4096 and arch.rope_scaling == ("yarn", 4.0, 4096)

    def plan(max_length: int):
        recipe = validate_recipe(
            {"model": str(model), "method": "lora", "data": "d.jsonl", "max_length": max_length}, tmp_path, "r"
        )
        return plan_for(recipe, from_spec("1xH100-80GB"), tokens=1e6, arch=arch)

    notes = "\n".join(plan(12000).notes)
    assert "max_length 12,000 is beyond the model's max_position_embeddings 4,096" in notes
    assert "RoPE scaling (yarn, factor 4 over 4,096 positions: up to 16,384)" in notes
    assert not any("max_position_embeddings" in n for n in plan(4096).notes)
    with pytest.raises(RecipeError, match=r"even with its config's scaling \(yarn, factor 4"):
        plan(20000)
