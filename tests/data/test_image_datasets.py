"""Images as Hub datasets carry them: Hugging Face datasets' Image feature stored as {"bytes", "path"} in parquet
shards, a dataset saved with save_to_disk, and a Hub dataset read from the HF cache, in the column layouts such
datasets have (launcher/data/images.py). Each dataset is built here with `datasets` from the repository's own
images (recipes/data/tiny-vision)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.data.dataset import load_data
from launcher.data.images import load_images
from launcher.data.stats import data_stats
from launcher.errors import DataError
from launcher.recipe_loading import load_recipe
from tests.conftest import recipe_file

IMAGES = sorted((Path(__file__).parents[2] / "recipes" / "data" / "tiny-vision").glob("*.png"))[:4]
ANSWERS = ["red.", "green.", "blue.", "yellow."]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Image bytes are written under FTRUN_CACHE: a folder of the test's own."""
    monkeypatch.setenv("FTRUN_CACHE", str(tmp_path / "cache"))


def _stored(path: Path) -> dict:
    """An image as the Image feature stores it in a Hub shard: its bytes and its file name."""
    return {"bytes": path.read_bytes(), "path": path.name}


def _features(**columns):
    import datasets

    return datasets.Features({k: v for k, v in columns.items()})


def _qa_dataset(rows: list[dict] | None = None):
    """image, question, answer: ChartQA's and most VQA sets' layout, with the Image feature."""
    import datasets

    rows = rows or [
        {"image": _stored(p), "question": "What colour is the square?", "answer": a} for p, a in zip(IMAGES, ANSWERS)
    ]
    features = _features(image=datasets.Image(), question=datasets.Value("string"), answer=datasets.Value("string"))
    return datasets.Dataset.from_list(rows, features=features)


def _size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def test_a_parquet_shard_with_an_image_feature_reads_as_conversations_with_each_image_measured(tmp_path):
    import pyarrow.parquet as pq

    shard = tmp_path / "train-00000-of-00001.parquet"
    _qa_dataset().to_parquet(str(shard))
    # the Image feature's storage, as the Hub's parquet shards have it (datasets features/image.py Image.pa_type)
    assert str(pq.read_schema(shard).field("image").type) == "struct<bytes: binary, path: string>"
    got = load_images(shard)
    assert got.where == [f"{shard.name} row {i}" for i in range(1, 5)]
    assert got.sizes == [[_size(p)] for p in IMAGES]
    first = got.examples[0]
    assert first["messages"] == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
        {"role": "assistant", "content": "red."},
    ]
    # the bytes became a file under FTRUN_CACHE that holds exactly them: what the run's processor reads
    (written,) = first["images"]
    assert (
        Path(written).parent == tmp_path / "cache" / "images" and Path(written).read_bytes() == IMAGES[0].read_bytes()
    )
    assert load_images(shard).sha256 == got.sha256  # read again: the same data


def test_a_folder_of_shards_reads_every_row_named_by_its_shard(tmp_path):
    ds = _qa_dataset()
    folder = tmp_path / "data"
    folder.mkdir()
    ds.select(range(2)).to_parquet(str(folder / "train-00000-of-00002.parquet"))
    ds.select(range(2, 4)).to_parquet(str(folder / "train-00001-of-00002.parquet"))
    got = load_data(str(folder))
    assert [e["messages"][1]["content"] for e in got.examples] == ANSWERS
    assert got.where[2] == "train-00001-of-00002.parquet row 1"


def test_an_image_stored_as_its_path_alone_resolves_against_the_data_file(tmp_path):
    import datasets

    # encode_example keeps only the path of a local file (bytes None): relative to the shard's folder here
    rows = [
        {"image": {"bytes": None, "path": f"img/{p.name}"}, "question": "Colour?", "answer": "red."} for p in IMAGES
    ]
    for p in IMAGES:
        (tmp_path / "img").mkdir(exist_ok=True)
        (tmp_path / "img" / p.name).write_bytes(p.read_bytes())
    shard = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(shard))
    got = load_images(shard)
    assert got.examples[1]["images"] == [str((tmp_path / "img" / IMAGES[1].name).resolve())]


def test_a_saved_dataset_with_an_images_column_beside_messages_reads_as_trl_takes_it(tmp_path):
    import datasets

    # TRL's vision examples' layout (HuggingFaceH4/llava-instruct-mix-vsft): messages with image placeholders and an
    # images column, a list of Image features
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": a}]},
            ],
            "images": [_stored(p)],
        }
        for p, a in zip(IMAGES, ANSWERS)
    ]
    ds = datasets.Dataset.from_list(rows)
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    ds.save_to_disk(str(tmp_path / "saved"))
    got = load_data(str(tmp_path / "saved"))
    assert got.where[3] == "saved row 4" and got.examples[3]["messages"][1]["content"] == "yellow."
    assert Path(got.examples[3]["images"][0]).read_bytes() == IMAGES[3].read_bytes()


def test_an_ocr_layout_without_a_question_puts_the_image_alone_in_the_user_turn(tmp_path):
    import datasets

    # unsloth/LaTeX_OCR: image and text, the text the answer
    ds = datasets.Dataset.from_list(
        [{"image": _stored(p), "text": r"\frac{1}{2}"} for p in IMAGES],
        features=_features(image=datasets.Image(), text=datasets.Value("string")),
    )
    ds.to_parquet(str(tmp_path / "ocr.parquet"))
    got = load_images(tmp_path / "ocr.parquet")
    assert got.examples[0]["messages"] == [
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "assistant", "content": r"\frac{1}{2}"},
    ]


def test_columns_map_a_chartqa_layout_and_other_columns_are_refused_or_ignored(tmp_path):
    import datasets

    # HuggingFaceM4/ChartQA: image, query, label (a list of one answer), human_or_machine
    ds = datasets.Dataset.from_list(
        [
            {"image": _stored(p), "query": "Colour?", "label": [a], "human_or_machine": 0}
            for p, a in zip(IMAGES, ANSWERS)
        ]
    )
    shard = tmp_path / "chartqa.parquet"
    ds.to_parquet(str(shard))
    with pytest.raises(DataError) as exc:
        load_images({"path": str(shard), "columns": {"answer": "label"}})
    assert "chartqa.parquet row 1" in exc.value.message and "'human_or_machine'" in exc.value.message
    got = load_images({"path": str(shard), "columns": {"answer": "label"}, "ignore": ["human_or_machine"]})
    assert got.examples[2]["messages"][0]["content"][1] == {"type": "text", "text": "Colour?"}
    assert got.examples[2]["messages"][1]["content"] == "blue."
    with pytest.raises(DataError) as exc:
        load_images({"path": str(shard), "ignore": ["human_or_machine"]})
    assert "needs an answer column" in exc.value.message and "columns: {answer: label}" in exc.value.message


def test_image_bytes_that_do_not_decode_are_refused_with_the_row_and_the_column(tmp_path):
    rows = [{"image": _stored(p), "question": "Colour?", "answer": a} for p, a in zip(IMAGES, ANSWERS)]
    rows[1]["image"] = {"bytes": IMAGES[1].read_bytes()[:60], "path": "0001.png"}  # a truncated PNG
    rows[2]["image"] = None
    rows[3]["image"] = {"bytes": None, "path": None}
    shard = tmp_path / "d.parquet"
    # written with pyarrow itself: the Image feature's struct, with the nulls datasets' own encoder would not write
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), shard)
    with pytest.raises(DataError) as exc:
        load_images(shard)
    msg = exc.value.message
    assert "3 bad records" in msg and "row 1" not in msg
    assert "d.parquet row 2: column image (image bytes of 0001.png) does not decode as an image" in msg
    assert "d.parquet row 3: column image is empty (null)" in msg
    assert "d.parquet row 4: column image is an image struct" in msg and "neither image bytes nor a path" in msg


def test_a_url_and_a_relative_path_in_a_hub_dataset_are_refused_with_the_row(tmp_path, monkeypatch):
    import datasets

    from helpers import make_hub_cache

    rows = [{"image": {"bytes": None, "path": v}, "question": "Colour?", "answer": "red."} for v in ("a.png",)]
    rows.append({"image": {"bytes": None, "path": "https://example.org/a.png"}, "question": "?", "answer": "red."})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", make_hub_cache(tmp_path / "hf", "acme/bad", rows))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as exc:
        load_data("acme/bad")
    msg = exc.value.message
    assert "acme/bad row 1: column image is a relative path (a.png) in a Hub dataset" in msg
    assert "acme/bad row 2: column image is a URL (https://example.org/a.png)" in msg


def test_a_hub_dataset_with_an_image_feature_reads_through_the_hf_cache_and_plans(tmp_path, monkeypatch, tiny_vlm):
    import datasets

    from helpers import HUB_REVISION, make_hub_cache

    rows = [
        {"image": _stored(p), "question": "What colour is the square?", "answer": a} for p, a in zip(IMAGES, ANSWERS)
    ]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", make_hub_cache(tmp_path / "hf", "acme/squares", rows))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    got = load_data({"path": "acme/squares"})
    assert got.where[0] == "acme/squares row 1" and got.sources[0]["revision"] == HUB_REVISION
    assert Path(got.examples[0]["images"][0]).read_bytes() == IMAGES[0].read_bytes()
    # the plan: every image measured and its tokens counted with the processor's rule, as for files
    recipe = load_recipe(recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", data="acme/squares"))
    _, lengths, stats = data_stats(recipe)
    assert stats.images["images"] == stats.examples and stats.images["image_tokens"] > stats.examples
    assert stats.images["longest_example"]["where"].startswith("acme/squares row ")


def _pairs(images_column: bool = True) -> list[dict]:
    """Image preference pairs: the prompt a question about the image, chosen the square's colour, rejected another."""
    rows = []
    for k, (p, a) in enumerate(zip(IMAGES, ANSWERS)):
        wrong = ANSWERS[(k + 1) % len(ANSWERS)]
        if images_column:  # RLAIF-V's layout: a string prompt and an images column (TRL puts them before the text)
            rows.append(
                {"images": [_stored(p)], "prompt": "What colour is the square?", "chosen": a, "rejected": wrong}
            )
        else:
            user = [{"type": "image", "image": str(p)}, {"type": "text", "text": "What colour is the square?"}]
            rows.append({"prompt": [{"role": "user", "content": user}], "chosen": a, "rejected": wrong})
    return rows


def test_image_preference_pairs_read_as_trl_s_dpo_trainer_takes_them(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(_pairs()).cast_column("images", datasets.List(datasets.Image()))
    ds.to_parquet(str(tmp_path / "pairs.parquet"))
    got = load_images(tmp_path / "pairs.parquet")
    assert got.pairs and got.describe().startswith("preference pairs with images, 4 pairs, 4 images")
    # dpo_trainer.py DataCollatorForVisionPreference: a conversational prompt with the image placeholders, one
    # assistant turn per answer, the images in placeholder order
    assert got.examples[0] == {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}
        ],
        "chosen": [{"role": "assistant", "content": "red."}],
        "rejected": [{"role": "assistant", "content": "green."}],
        "images": got.examples[0]["images"],
    }
    assert Path(got.examples[0]["images"][0]).read_bytes() == IMAGES[0].read_bytes()
    inline = tmp_path / "pairs.jsonl"
    inline.write_text("".join(json.dumps(r) + "\n" for r in _pairs(images_column=False)))
    assert [e["prompt"] for e in load_images(inline).examples] == [e["prompt"] for e in got.examples]


@pytest.mark.parametrize(
    "objective, pairs, said",
    [
        ("dpo", False, "holds conversations (first at d.jsonl line 1), and objective dpo trains preference pairs"),
        ("sft", True, "holds preference pairs (prompt, chosen, rejected) (first at d.jsonl line 1), and objective sft"),
    ],
)
def test_image_data_of_the_other_form_is_refused_under_each_objective(tmp_path, tiny_vlm, objective, pairs, said):
    rows = (
        _pairs(images_column=False)
        if pairs
        else [
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": str(p)}, {"type": "text", "text": "?"}]},
                    {"role": "assistant", "content": a},
                ]
            }
            for p, a in zip(IMAGES, ANSWERS)
        ]
    )
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(
        recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", data=str(data), objective=objective)
    )
    with pytest.raises(DataError) as exc:
        data_stats(recipe)
    assert said in exc.value.message
    assert ("dpo" if pairs else "sft") in exc.value.fix


def test_image_pairs_plan_with_both_sequences_counted_and_a_precomputed_reference_refused(tmp_path, tiny_vlm):
    from launcher.errors import RecipeError

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _pairs(images_column=False)))
    recipe = load_recipe(recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", data=str(data), objective="dpo"))
    examples, lengths, stats = data_stats(recipe)
    from launcher.data.image_tokens import read_rule

    rule = read_rule(tiny_vlm)
    # each pair trains as two sequences, the prompt and its image before each answer: both hold the image's tokens
    assert all(n > 2 * rule.tokens(*_size(p)) for n, p in zip(lengths, IMAGES))
    assert stats.description.startswith("preference pairs with images")
    # the tower sees each pair's image twice (once per answer): the plan's image tokens and patches say so
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    w, h = _size(IMAGES[longest])
    assert stats.images["longest_example"]["image_tokens"] == 2 * rule.tokens(w, h)
    assert stats.images["patches_longest"] == 2 * rule.patches(w, h)
    pre = load_recipe(
        recipe_file(
            tmp_path / "p.yaml",
            tiny_vlm,
            tmp_path / "run2",
            data=str(data),
            objective="dpo",
            preference={"reference": "precomputed"},
        )
    )
    with pytest.raises(RecipeError) as exc:
        data_stats(pre)
    assert "precompute_ref_log_probs" in exc.value.message
