"""`ftrun plan` answers for the box you name: the recipe's box:, the software of ftrun's image, the box billed
whole, JSON that is always JSON, card sizes in one unit, the rental catalog, setup and download, suggestions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher import cli
from launcher.plan import this_box
from launcher.run import pipeline, plan_command
from launcher.plan import sizing_constants
from launcher.plan import plan as plan_mod
from launcher.plan import engine_software
from launcher.errors import MissingSoftware, PlanError, RecipeError
from launcher.plan.hardware import Hardware, catalog, from_spec, lookup
from launcher.plan.models import _weights_bytes, download_size, from_catalog
from launcher.plan.figures import UNIT
from launcher.plan.plan import make_plan
from launcher.plan.text import format_plan
from launcher.recipe import TOKENS_MEANING, Recipe, parse_token_count
from launcher.recipe_loading import _suggest, validate_recipe

REPO = Path(__file__).resolve().parents[2]
README_RECIPE = REPO / "recipes" / "qwen3-8b-qlora-rtx4090.yaml"


def cpu_only() -> Hardware:
    return Hardware((), "none", 2, 24.0, "detected")


def detected(spec: str) -> Hardware:
    """A GPU box as detect() reports the machine it runs on (its own software counts)."""
    box = from_spec(spec)
    return Hardware(box.gpus, box.interconnect, box.cpu_count, box.ram_gb, "detected")


@pytest.fixture
def no_gpu_here(monkeypatch):
    monkeypatch.setattr(this_box, "detect", cpu_only)


def recipe(tmp_path, **fields):
    base = {
        "model": "meta-llama/Llama-3.1-8B",
        "method": "qlora",
        "data": "absent.jsonl",
        "max_length": 2048,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 8,
    }
    base.update(fields)
    return validate_recipe(base, tmp_path, "r")


def write_recipe(tmp_path, **fields) -> str:
    import yaml

    base = {"model": "Qwen/Qwen3-8B", "method": "qlora", "data": "absent.jsonl", "output_dir": str(tmp_path / "run")}
    base.update(fields)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(base))
    return str(path)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- the README's first command, the recipe's box: and tokens: -------------------------------------


def test_readme_first_command_works_as_printed(no_gpu_here, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, out, err = run_cli(capsys, "plan", "recipes/qwen3-8b-qlora-rtx4090.yaml")
    assert rc == 0, err
    assert out.startswith("Plan: qlora of Qwen/Qwen3-8B on 1 x RTX4090 (24 GB) -> engine unsloth")
    assert "box: the recipe's box: 1xRTX4090 (this machine has no GPU" in out
    assert "Docker image" in out and "recipe's tokens:" in out
    hours = make_plan(pipeline.load_recipe(str(README_RECIPE)), from_spec("RTX4090"), tokens=15e6).estimate["hours"]
    assert hours == pytest.approx(2 + 50 / 60, rel=0.15)  # the article's Unsloth row: 2 h 50, 1.65 EUR


def test_gpus_and_a_detected_gpu_win_over_the_recipe_box(monkeypatch):
    hw, why = this_box.for_plan("8xH100-80GB", "1xRTX4090")
    assert (hw.count, hw.gpu.name, why) == (8, "H100-80GB", "--gpus 8xH100-80GB")
    monkeypatch.setattr(this_box, "detect", lambda: detected("A100-80GB"))
    hw, why = this_box.for_plan(None, "1xRTX4090")
    assert hw.gpu.name == "A100-80GB" and hw.is_this_machine
    assert "detected" in why and "box: 1xRTX4090 is not used here" in why and "--gpus 1xRTX4090" in why
    monkeypatch.setattr(this_box, "detect", cpu_only)
    hw, why = this_box.for_plan(None, "1xRTX4090")
    assert hw.gpu.name == "RTX4090" and not hw.is_this_machine and "recipe's box" in why
    hw, why = this_box.for_plan(None, None)
    assert hw.is_cpu_only and "no GPU" in why


def test_a_bad_box_names_the_field(no_gpu_here):
    with pytest.raises(Exception) as err:
        this_box.for_plan(None, "1xGTX480")
    assert "box: '1xGTX480'" in err.value.message and "RTX4090" in err.value.fix


def test_tokens_mean_one_thing_everywhere(tmp_path, no_gpu_here, capsys):
    """Training tokens in all, every epoch together: the help, the recipe key, the errors and the plan agree."""
    assert "every epoch together" in TOKENS_MEANING
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--tokens N training tokens in all: every epoch together" in help_text
    assert "every epoch together" in Recipe.model_fields["tokens"].description.lower()
    with pytest.raises(RecipeError) as err:
        parse_token_count("lots")
    assert TOKENS_MEANING in err.value.fix
    assert parse_token_count("15M") == 15_000_000 and parse_token_count(250_000) == 250_000
    with pytest.raises(RecipeError) as err:
        recipe(tmp_path, tokens="many")
    assert "'tokens'" in err.value.message and "every epoch together" in err.value.message
    rc, out, _ = run_cli(capsys, "plan", write_recipe(tmp_path, tokens="15M", epochs=3), "--gpus", "RTX4090")
    assert rc == 0 and "15.00M training tokens (the recipe's tokens:)" in out and TOKENS_MEANING in out
    rc, out, _ = run_cli(capsys, "plan", write_recipe(tmp_path, tokens="15M"), "--gpus", "RTX4090", "--tokens", "30M")
    assert "30.00M training tokens (--tokens)" in out


def test_without_data_or_tokens_it_plans_memory_and_says_how_to_give_them(tmp_path, no_gpu_here, capsys):
    rc, out, _ = run_cli(capsys, "plan", write_recipe(tmp_path), "--gpus", "RTX4090")
    assert rc == 0 and "Memory per GPU" in out
    assert "add `tokens: 15M` to the recipe or pass --tokens 15M" in out and "Time:   unknown" in out


# --- software: the image for a named box, what is installed for this one -----------------------------


def test_a_named_box_has_the_images_software(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_software, "_unsloth_installed", lambda: False)
    p = make_plan(recipe(tmp_path, engine="unsloth"), from_spec("RTX4090"), tokens=15e6)
    assert p.fits and p.engine == "unsloth" and any("Docker image" in r for r in p.reasons)
    auto = make_plan(recipe(tmp_path), from_spec("RTX4090"), tokens=15e6)
    assert auto.engine == "unsloth"  # not trl because this laptop lacks Unsloth


def test_this_machine_uses_what_is_installed_and_names_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine_software, "_unsloth_installed", lambda: False)
    p = make_plan(recipe(tmp_path), detected("RTX4090"), tokens=15e6)
    assert p.engine == "trl" and any(
        "Unsloth not installed on this machine" in r and ".venv-unsloth" in r for r in p.reasons
    )
    with pytest.raises(MissingSoftware) as err:
        make_plan(recipe(tmp_path, engine="unsloth"), detected("RTX4090"), tokens=15e6)
    assert err.value.exit_code == 2 and "does not fit" not in err.value.render()
    assert "missing software" in err.value.render() and "pip install" in err.value.message
    monkeypatch.setattr(this_box, "detect", lambda: detected("RTX4090"))
    rc, out, _ = run_cli(capsys, "plan", write_recipe(tmp_path, engine="unsloth"), "--json")
    d = json.loads(out)
    assert rc == 2 and d["fits"] is False and d["refusal"]["missing"] == "unsloth"


def test_a_job_only_unsloth_fits_here_is_missing_software_not_too_big(tmp_path, monkeypatch):
    """Qwen3-32B QLoRA at 6k tokens on the RTX 4090 in hand: trl needs more than the card even with activation
    offloading, Unsloth less. Without Unsloth here the fix is its install (exit 2), not a bigger box (exit 3)."""
    monkeypatch.setattr(engine_software, "_unsloth_installed", lambda: False)
    big = recipe(tmp_path, model="Qwen/Qwen3-32B", max_length=6144)
    assert make_plan(big, from_spec("1xRTX4090"), tokens=15e6).engine == "unsloth"  # a rented box has the image
    with pytest.raises(MissingSoftware) as err:
        make_plan(big, detected("RTX4090"), tokens=15e6)
    text = err.value.render()
    assert "fits this box only with Unsloth" in text and ".venv-unsloth" in text and "does not fit" not in text
    monkeypatch.setattr(engine_software, "_unsloth_installed", lambda: True)
    assert make_plan(big, detected("RTX4090"), tokens=15e6).engine == "unsloth"


def test_deepspeed_missing_here_is_missing_software(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_software, "_deepspeed_installed", lambda: False)
    r = recipe(tmp_path, method="full", engine="deepspeed")
    assert make_plan(r, from_spec("4xH100-80GB"), tokens=15e6).engine == "deepspeed"  # the image has it
    with pytest.raises(MissingSoftware, match="pip install 'ftrun\\[deepspeed\\]'"):
        make_plan(r, detected("4xH100-80GB"), tokens=15e6)


# --- the box in hand is billed whole --------------------------------------------------------------


def test_8xh100_uses_its_cards_and_shows_the_cheapest_box_to_rent(tmp_path):
    r = recipe(tmp_path, model="meta-llama/Llama-3.1-70B", micro_batch_size=2, gradient_accumulation_steps=4)
    p = make_plan(r, from_spec("8xH100-80GB"), tokens=15e6, unsloth_available=True)
    one = make_plan(r, from_spec("1xH100-80GB"), tokens=15e6, unsloth_available=False)  # what it planned before
    assert (p.engine, p.num_processes, p.gpus["box_count"]) == ("ddp", 8, 8)
    assert p.estimate["hours"] < one.estimate["hours"] / 5 and p.estimate["cost_eur"] < one.estimate["cost_eur"] * 8 / 5
    assert any("billed whole" in r for r in p.reasons)
    text = format_plan(p)
    assert text.startswith(
        "Plan: qlora of meta-llama/Llama-3.1-70B on 8 x H100-80GB (80 GB each) -> engine ddp, 8 processes"
    )
    rent = p.cheapest_rental
    assert rent and rent["gpus"].startswith("1x") and rent["cost_eur"] < p.estimate["cost_eur"]
    assert f"the cheapest box to rent instead is {rent['gpus']}" in text and f"{p.estimate['cost_eur']:.2f} EUR" in text


def test_the_checkpoint_interval_is_the_clocks_and_its_steps_an_estimate(tmp_path):
    """Checkpoints follow the clock (checkpoint_every_minutes), so the step count is said as an estimate."""
    p = make_plan(recipe(tmp_path, checkpoint_every_minutes=20), from_spec("RTX4090"), tokens=15e6)
    assert p.checkpoint_every_minutes == 20 and p.to_dict()["checkpoint_every_minutes"] == 20
    assert f"checkpoint about every {p.checkpoint_every_steps} steps (every 20 minutes by the clock)" in format_plan(p)
    p = make_plan(recipe(tmp_path, checkpoint_every_minutes=0.25), from_spec("RTX4090"), tokens=15e6)
    assert f"checkpoint about every {p.checkpoint_every_steps} steps (every 15 s by the clock)" in format_plan(p)


def test_header_says_when_cards_stay_idle(tmp_path):
    p = make_plan(recipe(tmp_path, engine="unsloth"), from_spec("2xRTX4090"), tokens=15e6)
    assert (p.engine, p.num_processes) == ("unsloth", 1)
    assert "on 1 of the box's 2 x RTX4090 (24 GB each)" in format_plan(p)
    assert any("the box has 2 cards; 1 GPU stays idle (billed all the same)" in r for r in p.reasons), p.reasons
    p = make_plan(recipe(tmp_path, engine="unsloth"), from_spec("4xRTX4090"), tokens=15e6)
    assert any("the box has 4 cards; 3 GPUs stay idle (billed all the same)" in r for r in p.reasons), p.reasons


# --- --json is always JSON ------------------------------------------------------------------------


def test_json_when_nothing_fits(tmp_path, no_gpu_here, capsys):
    rc, out, err = run_cli(
        capsys,
        "plan",
        write_recipe(tmp_path, model="Qwen/Qwen2.5-32B", method="full", tokens="15M"),
        "--gpus",
        "RTX4090",
        "--json",
    )
    d = json.loads(out)
    assert rc == 3 and err == "" and d["fits"] is False
    assert d["memory"]["total_gb"] > 500 and d["memory"]["breakdown_gb"]["optimizer"] > 200
    assert "does not fit" in d["refusal"]["message"] and d["refusal"]["options"] and d["reasons"]
    assert d["alternatives"] and d["units"].startswith("GB = 2**30")
    for a in d["alternatives"]:  # only boxes that hold it: never 2xRTX4090 for 564 GB
        assert a["per_gpu_gb"] <= a["card_gb"] * sizing_constants.USABLE_FRACTION
    assert not any("RTX4090" in o for o in d["refusal"]["options"])


def test_json_of_a_forced_engine_refusal_says_what_the_job_needs(tmp_path, no_gpu_here, capsys):
    """A forced engine refused before sizing (fsdp on one card) still prints the memory with its breakdown."""
    rc, out, _ = run_cli(
        capsys,
        "plan",
        write_recipe(tmp_path, model="Qwen/Qwen2.5-32B", method="full", tokens="15M", engine="fsdp"),
        "--gpus",
        "RTX4090",
        "--json",
    )
    d = json.loads(out)
    assert rc == 3 and d["fits"] is False and "needs 2 or more GPUs" in d["refusal"]["why"]
    assert d["memory"]["per_gpu_gb"] > 24 and d["memory"]["breakdown_gb"]["optimizer"] > 100


def test_json_for_a_bad_recipe(tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "plan", write_recipe(tmp_path, lr=0.1), "--json")
    d = json.loads(out)
    assert rc == 2 and d["fits"] is None and d["error"] == "recipe error" and "learning_rate" in d["message"]


# --- units ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,size", [("RTX4090", 24), ("H100-80GB", 80), ("A100-80GB", 80), ("RTX3090", 24), ("T4", 15), ("H200", 140)]
)
def test_card_sizes_as_people_know_them(name, size):
    assert round(catalog()[name].memory_gb) == size
    assert f"({size} GB)" in from_spec(name).describe()


def test_one_unit_said_once(tmp_path):
    assert sizing_constants.GB == 2**30
    p = make_plan(recipe(tmp_path), from_spec("RTX4090"), tokens=15e6)
    text = format_plan(p)
    assert text.count("2**30") == 1 and p.to_dict()["units"] == UNIT
    assert "of 24.0 GB" in text


# --- the rental catalog -----------------------------------------------------------------------------


def test_catalog_has_the_cards_people_rent():
    for name in ("T4", "L4", "A10G", "A10", "RTX3090", "RTXA6000", "A40", "L40", "L40S", "H200", "RTX6000Ada"):
        assert name in catalog()


@pytest.mark.parametrize(
    "nvml,name",
    [
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA RTX A6000", "RTXA6000"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX6000Ada"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 3090", "RTX3090"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ],
)
def test_a_detected_name_matches_the_most_specific_entry(nvml, name):
    assert lookup(nvml).name == name


def test_a_card_without_a_price_plans_and_price_sets_one(tmp_path, no_gpu_here, capsys):
    assert catalog()["H100-NVL"].price_per_hour_eur is None
    p = make_plan(recipe(tmp_path), from_spec("H100-NVL"), tokens=15e6)
    assert p.fits and p.estimate["cost_eur"] is None and p.price_per_hour_eur is None
    assert any("--price EUR/h" in n for n in p.notes) and "no price known" in format_plan(p)
    rc, out, _ = run_cli(
        capsys, "plan", write_recipe(tmp_path, tokens="15M"), "--gpus", "H100-NVL", "--price", "2.5", "--json"
    )
    d = json.loads(out)
    assert rc == 0 and d["price_per_hour_eur"] == 2.5
    assert d["estimate"]["cost_eur"] == pytest.approx(d["estimate"]["hours"] * 2.5, abs=0.01)


# --- setup and download ------------------------------------------------------------------------------


def test_setup_and_download_are_in_the_estimate(tmp_path):
    p = make_plan(recipe(tmp_path, model="Qwen/Qwen3-8B"), from_spec("RTX4090"), tokens=15e6)
    e = p.estimate
    d = e["download"]
    assert p.engine == "unsloth" and d["repo"] == "unsloth/Qwen3-8B-bnb-4bit" and 4 < d["gb"] < 8
    assert "estimated from the architecture" in d["source"]  # the Hub is not reachable here
    assert e["setup_hours"] == pytest.approx((plan_mod.SETUP_MINUTES * 60 + d["bytes"] / 100e6) / 3600, rel=0.01)
    assert e["total_hours"] == pytest.approx(e["hours"] + e["setup_hours"], abs=0.002)
    assert any("pre-quantized 4-bit repository unsloth/Qwen3-8B-bnb-4bit" in r for r in p.reasons)
    assert "Setup:" in format_plan(p) and "100 MB/s" in format_plan(p)


def test_qlora_70b_downloads_a_quarter_with_the_4bit_repo(tmp_path):
    arch = from_catalog("meta-llama/Llama-3.1-70B-Instruct")
    full = download_size("meta-llama/Llama-3.1-70B-Instruct", arch)
    four = download_size("meta-llama/Llama-3.1-70B-Instruct", arch, "unsloth/Meta-Llama-3.1-70B-Instruct-bnb-4bit")
    assert 125 < full.bytes / 2**30 < 135 and 35 < four.bytes / 2**30 < 42  # the article: 141 GB and ~40 GB (decimal)
    p = make_plan(
        recipe(tmp_path, model="meta-llama/Llama-3.1-70B-Instruct"),
        from_spec("H100-80GB"),
        tokens=15e6,
        unsloth_available=False,
    )
    assert p.engine == "trl" and p.estimate["download"]["repo"] == "meta-llama/Llama-3.1-70B-Instruct"
    assert any("model=unsloth/Meta-Llama-3.1-70B-Instruct-bnb-4bit to use it" in r for r in p.reasons)


def test_download_size_from_the_hubs_listing(monkeypatch):
    """Online, the size is what the Hub lists (huggingface_hub's model_info with files_metadata), asked of a local
    server that answers GET /api/models/ORG/NAME like the Hub (siblings with rfilename and size)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import huggingface_hub.constants

    listing = [
        {"rfilename": "model-00001-of-00002.safetensors", "size": 4_000_000_000},
        {"rfilename": "model-00002-of-00002.safetensors", "size": 2_000_000_000},
        {"rfilename": "config.json", "size": 900},
    ]
    seen = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.path)
            body = json.dumps({"id": "org/model", "sha": "0" * 40, "siblings": listing}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("FTRUN_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        got = download_size("org/model", from_catalog("Qwen/Qwen3-8B"))
    finally:
        server.shutdown()
        server.server_close()
    assert got.bytes == 6_000_000_000 and got.source == "Hub metadata (file sizes)" and not got.cached
    assert seen and seen[0].startswith("/api/models/org/model")


def test_weight_files_from_a_hub_listing():
    listing = {
        "model-00001-of-00002.safetensors": 5,
        "model-00002-of-00002.safetensors": 3,
        "pytorch_model.bin": 8,
        "config.json": 1,
        "original/consolidated.00.pth": 8,
    }
    assert _weights_bytes(listing) == 8  # safetensors only: from_pretrained loads those, not the .bin copy
    assert _weights_bytes({"pytorch_model.bin": 8, "original/consolidated.00.pth": 8, "tokenizer.json": 2}) == 8


# --- suggestions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typo,meant",
    [
        ("lr", "learning_rate"),
        ("learnig_rate", "learning_rate"),
        ("max_len", "max_length"),
        ("lora.rr", "lora.r"),
        ("epoch", "epochs"),
    ],
)
def test_did_you_mean_only_when_close(typo, meant):
    assert _suggest(typo) == f" (did you mean '{meant}'?)"


@pytest.mark.parametrize("far", ["zz", "optimizer_kind", "xyz.abc"])
def test_no_suggestion_for_a_far_name(far):
    assert _suggest(far) == ""


def test_alternatives_only_hold_the_job(tmp_path):
    with pytest.raises(PlanError) as err:
        make_plan(recipe(tmp_path, model="Qwen/Qwen2.5-32B", method="full"), from_spec("RTX4090"), tokens=15e6)
    p = err.value.plan
    assert p.alternatives and all(
        a["per_gpu_gb"] <= a["card_gb"] * sizing_constants.USABLE_FRACTION for a in p.alternatives
    )
    assert all(not math.isnan(a["per_gpu_gb"]) for a in p.alternatives)
    assert "2xRTX4090" not in err.value.fix


def test_plan_checks_the_trainer_fields(tmp_path, no_gpu_here, capsys, monkeypatch):
    seen = []

    def check(r):  # launcher.recipe_trainer.check_trainer_fields, called by plan (its own checks: tests/test_recipe.py)
        seen.append(dict(r.trainer))
        raise RecipeError("the recipe's trainer: section has unknown fields:\n- trainer.warmup_ratoi ...")

    monkeypatch.setattr(plan_command, "check_trainer_fields", check)
    rc, _, err = run_cli(capsys, "plan", write_recipe(tmp_path, trainer={"warmup_ratoi": 0.1}), "--gpus", "RTX4090")
    assert rc == 2 and seen == [{"warmup_ratoi": 0.1}] and "warmup_ratoi" in err
