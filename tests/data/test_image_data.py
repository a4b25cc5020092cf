"""Image data: read into TRL's vision layout with every image opened, counted with the processor's own rule, and each
bad input refused before any training with its line and path (launcher/data/images.py, image_stats.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.data.image_stats import image_stats
from launcher.data.image_tokens import read_rule
from launcher.data.images import data_has_images, load_images
from launcher.data.stats import data_stats, with_data_defaults
from launcher.errors import DataError, RecipeError
from launcher.recipe_loading import load_recipe
from tests.conftest import recipe_file


def _png(path: Path, size=(56, 84), colour=(200, 20, 20)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _chat(image: str, question: str = "What colour is the square?", answer: str = "red.") -> dict:
    user = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def _write(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _data(tmp_path: Path, n: int = 4, **sizes) -> Path:
    for i in range(n):
        _png(tmp_path / "data" / "img" / f"{i}.png", sizes.get(str(i), (56, 84)))
    return _write(tmp_path / "data" / "d.jsonl", [_chat(f"img/{i}.png") for i in range(n)])


def _recipe(tmp_path: Path, model: Path, data: Path, **fields):
    return load_recipe(recipe_file(tmp_path / "r.yaml", model, tmp_path / "run", data=str(data), **fields))


def test_relative_paths_resolve_against_the_data_file_and_both_layouts_read_alike(tmp_path):
    data = _data(tmp_path, n=2)
    got = load_images(data)
    assert got.examples[0]["images"] == [str((tmp_path / "data" / "img" / "0.png").resolve())]
    assert got.sizes == [[(56, 84)], [(56, 84)]]
    assert got.examples[0]["messages"][0]["content"][0] == {"type": "image"}
    # the same data as an images column beside messages with placeholders, and with none (TRL's rule: before the
    # first user turn's text)
    placeholder = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
            {"role": "assistant", "content": "red."},
        ],
        "images": ["img/0.png"],
    }
    bare = {
        "messages": [
            {"role": "user", "content": "What colour is the square?"},
            {"role": "assistant", "content": "red."},
        ],
        "images": ["img/0.png"],
    }
    other = load_images(_write(tmp_path / "data" / "e.jsonl", [placeholder, bare]))
    assert other.examples[0] == other.examples[1] == got.examples[0]
    assert data_has_images(data) and not data_has_images(Path(__file__).parents[2] / "recipes/data/tiny-chat.jsonl")


def test_a_missing_image_is_refused_with_its_line_and_path(tmp_path):
    data = _data(tmp_path, n=2)
    _write(data, [_chat("img/0.png"), _chat("img/nope.png")])
    with pytest.raises(DataError) as exc:
        load_images(data)
    assert "d.jsonl line 2" in exc.value.message
    assert str(tmp_path / "data" / "img" / "nope.png") in exc.value.message and "does not exist" in exc.value.message


def test_an_image_that_does_not_decode_is_refused_with_its_line_and_path(tmp_path):
    data = _data(tmp_path, n=2)
    bad = tmp_path / "data" / "img" / "1.png"
    bad.write_bytes(bad.read_bytes()[:60])  # a truncated PNG: its header reads, its pixels do not
    with pytest.raises(DataError) as exc:
        load_images(data)
    assert "d.jsonl line 2" in exc.value.message and str(bad) in exc.value.message
    assert "does not decode" in exc.value.message and "line 1" not in exc.value.message


def test_more_or_fewer_image_placeholders_than_images_are_refused(tmp_path):
    _data(tmp_path, n=2)
    two = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "red."},
        ],
        "images": ["img/0.png"],
    }
    data = _write(tmp_path / "data" / "m.jsonl", [_chat("img/0.png"), two])
    with pytest.raises(DataError) as exc:
        load_images(data)
    assert "m.jsonl line 2" in exc.value.message
    assert "2 image placeholders in the turns and 1 image in the 'images' column" in exc.value.message


def test_image_data_for_a_model_without_a_vision_tower_is_refused(tmp_path, tiny_model):
    recipe = _recipe(tmp_path, tiny_model, _data(tmp_path))
    with pytest.raises(DataError) as exc:
        data_stats(recipe)
    assert "no vision tower" in exc.value.message and str(tiny_model) in exc.value.message


def test_image_data_under_an_objective_that_takes_none_is_refused(tmp_path, tiny_vlm):
    recipe = _recipe(tmp_path, tiny_vlm, _data(tmp_path), objective="orpo")
    with pytest.raises(DataError) as exc:
        data_stats(recipe)
    assert "objective orpo takes none" in exc.value.message and "d.jsonl line 1" in exc.value.message
    assert "sft" in exc.value.fix


def test_an_image_whose_tokens_alone_reach_max_length_is_refused(tmp_path, tiny_vlm):
    data = _data(tmp_path, n=3, **{"2": (112, 112)})  # 112 x 112: 16 tokens under the tiny processor's rule
    recipe = _recipe(tmp_path, tiny_vlm, data, max_length=16)
    with pytest.raises(DataError) as exc:
        data_stats(recipe)
    msg = exc.value.message
    assert "d.jsonl line 3" in msg and str(tmp_path / "data" / "img" / "2.png") in msg and "16 image tokens" in msg
    assert "line 1" not in msg
    data_stats(_recipe(tmp_path, tiny_vlm, data, max_length=64))  # room beside it: read


@pytest.mark.parametrize("field", ["packing", "padding_free"])
def test_packing_and_padding_free_are_refused_for_image_data(tmp_path, tiny_vlm, field):
    recipe = _recipe(tmp_path, tiny_vlm, _data(tmp_path), **{field: True})
    with pytest.raises(RecipeError) as exc:
        data_stats(recipe)
    assert f"{field}: true with image data" in exc.value.message and "M-RoPE" in exc.value.message


def test_padding_free_left_to_its_default_is_turned_off_for_image_data(tmp_path, tiny_vlm):
    recipe = _recipe(tmp_path, tiny_vlm, _data(tmp_path))
    assert recipe.padding_free  # sft's default
    _, _, stats = data_stats(recipe)
    assert stats.images and not with_data_defaults(recipe, stats).padding_free


def test_the_rule_counts_what_the_processor_does(tiny_vlm):
    from launcher.worker.processor import load_processor

    processor = load_processor(tiny_vlm, say=lambda _: None)
    rule = read_rule(tiny_vlm)
    sizes = [(56, 56), (84, 56), (112, 112), (30, 200), (500, 300), (1000, 40), (57, 99)]
    expected = processor._get_num_multimodal_tokens(image_sizes=[[h, w] for w, h in sizes])["num_image_tokens"]
    assert [rule.tokens(w, h) for w, h in sizes] == expected
    assert len(set(expected)) > 3  # the sizes exercise the bounds, not one value


def test_each_example_counts_the_tokens_the_processor_hands_the_model(tmp_path, tiny_vlm):
    from launcher.worker.processor import load_processor

    data = _data(tmp_path, n=3, **{"1": (112, 112), "2": (140, 56)})
    examples, lengths, stats = image_stats(_recipe(tmp_path, tiny_vlm, data))
    processor = load_processor(tiny_vlm, say=lambda _: None)
    for ex, n in zip(examples, lengths):
        from trl.data_utils import prepare_multimodal_messages

        msgs = prepare_multimodal_messages(ex["messages"], images=ex["images"])
        out = processor.apply_chat_template([msgs], tokenize=True, return_dict=True)
        assert len(out["input_ids"][0]) == n
    assert stats.images["images"] == 3 and stats.images["longest_example"]["where"].endswith("line 2")


def _bad_inputs(tmp_path: Path, case: str, tiny_model: Path, tiny_vlm: Path) -> tuple[Path, dict, list[str]]:
    """(data, recipe fields, what the refusal must name) of each bad input the issue lists."""
    data = _data(tmp_path, n=3, **{"2": (112, 112)})
    img = tmp_path / "data" / "img"
    if case == "missing image":
        _write(data, [_chat("img/0.png"), _chat("img/nope.png")])
        return data, {}, ["d.jsonl line 2", str(img / "nope.png"), "does not exist"]
    if case == "does not decode":
        (img / "1.png").write_bytes((img / "1.png").read_bytes()[:60])
        return data, {}, ["d.jsonl line 2", str(img / "1.png"), "does not decode"]
    if case == "markers and images":
        two = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]}
        two["messages"].append({"role": "assistant", "content": "red."})
        two["images"] = ["img/0.png", "img/1.png"]
        _write(data, [_chat("img/0.png"), two])
        return data, {}, ["d.jsonl line 2", "1 image placeholder in the turns and 2 images"]
    if case == "no vision tower":
        return data, {"model": str(tiny_model)}, ["d.jsonl line 1", str(data), "no vision tower"]
    if case == "objective takes none":
        return data, {"objective": "orpo"}, ["d.jsonl line 1", "objective orpo takes none"]
    assert case == "tokens over max_length"
    return data, {"max_length": 16}, ["d.jsonl line 3", str(img / "2.png"), "16 image tokens"]


@pytest.mark.parametrize(
    "case",
    [
        "missing image",
        "does not decode",
        "markers and images",
        "no vision tower",
        "objective takes none",
        "tokens over max_length",
    ],
)
def test_ftrun_refuses_each_bad_input_before_any_training_with_the_line_and_the_path(
    tmp_path, tiny_model, tiny_vlm, case, capsys
):
    from launcher import cli

    data, fields, named = _bad_inputs(tmp_path, case, tiny_model, tiny_vlm)
    recipe = recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", data=str(data), **fields)
    rc = cli.main([str(recipe)])  # the launch itself, not only the plan
    out = capsys.readouterr()
    said = " ".join((out.out + out.err).split())  # the error paragraph is wrapped to the terminal's width
    assert rc == 2, said
    assert "Traceback" not in said
    for part in named:
        assert part in said, part
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "smoke").exists()


def test_the_loss_view_shows_each_image_as_one_marker_with_its_token_count(tmp_path, tiny_vlm):
    data = _data(tmp_path, n=3)
    _, lengths, stats = data_stats(_recipe(tmp_path, tiny_vlm, data, max_length=64))
    tokens = read_rule(tiny_vlm).tokens(56, 84)
    assert tokens > 1
    shown = "".join(text for text, _ in stats.loss_view["examples"][0]["segments"])
    assert f"[image: {tokens:,} tokens]" in shown and "<|image_pad|>" not in shown
    # the view counts the rows as the processor widens them: each image its tokens, not one placeholder
    assert stats.loss_view["examples"][0]["tokens"] == lengths[0]
    assert stats.loss_view["stats"]["image_tokens"] == tokens * stats.examples
