"""Every shipped recipe parses and plans for the box its `box:` names (on a machine without GPUs, as `ftrun plan RECIPE`
does), with its `tokens:`, and the plan agrees with the article's numbers in the header."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import stand_in_adapter
from launcher.plan import this_box
from launcher.plan import plan as plan_mod
from launcher.errors import PlanError
from launcher.plan.hardware import from_spec
from launcher.recipe_loading import load_recipe
from launcher.plan.sizing_constants import GB

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
HEADLINE = RECIPES[0].parent / "qwen3-8b-qlora.yaml"  # the design card's command: `ftrun recipes/qwen3-8b-qlora.yaml`
ARTICLE = [
    p
    for p in RECIPES
    if p.name not in ("tiny-cpu.yaml", "tiny-cpu-dpo.yaml", "tiny-cpu-grpo.yaml", "tiny-cpu-vision.yaml", HEADLINE.name)
]
# The plan is an estimate (docs/sizing.md); the article gives ranges and rounded figures.
TIME_COST_REL = 0.20
MEMORY_SLACK = 0.25  # below the low end or above the high end of the article's range
ARTICLE_GB = 1e9 / GB  # the article's GB are decimal (bytes per parameter x billions); ftrun's are 2**30 bytes


def header(path: Path) -> dict[str, str]:
    lines = [l for l in path.read_text().splitlines() if l.startswith("#")]
    expect = next((l for l in lines if l.startswith("# expect:")), None)
    box = next((l for l in lines if l.startswith("# Box:")), None)
    out = dict(kv.split("=", 1) for kv in expect.removeprefix("# expect:").split()) if expect else {}
    out["box_line"] = box or ""
    return out


@pytest.fixture
def no_gpu_here(monkeypatch):
    """This machine as the README's first command meets it: no GPU, so the recipe's box: is planned."""
    monkeypatch.setattr(this_box, "detect", lambda: from_spec("cpu").__class__((), "none", 2, 24.0, "detected"))


def tokens(text: str) -> float:
    return float(text[:-1]) * {"k": 1e3, "M": 1e6, "B": 1e9}[text[-1]]


def test_there_is_a_recipe_for_every_row_of_the_article():
    names = {p.stem for p in ARTICLE}
    for needed in (
        "qwen3-8b-qlora",
        "qwen3-8b-lora",
        "qwen3-8b-full-8bit",
        "qwen3-8b-full-4x",
        "qwen3-32b-qlora-l40s",
        "qwen3-32b-qlora-h100",
        "qwen3-32b-lora",
        "qwen3-32b-full-8bit",
        "qwen3-32b-full-8x",
        "llama-3.1-70b-qlora-a100",
        "llama-3.1-70b-qlora-h100",
        "llama-3.1-70b-qlora-fsdp-2xrtx4090",
        "llama-3.1-70b-lora",
        "llama-3.1-70b-full-8bit",
        "llama-3.1-70b-full-8x",
    ):
        assert any(n.startswith(needed) for n in names), needed
    assert (RECIPES[0].parent / "tiny-cpu.yaml").is_file()


# Full fine-tuning of the 8B on 4 x H100 with 2,048-token micro-batch rows (the data is not here, so the longest example
# is max_length): checkpointing stays on, and the H200's measured MFU gives 14,408 tokens/s, 4% under the article's
# 15,000-30,000 (docs/sizing.md, "Time and cost"). Kept visible until a 4-card measurement settles it.
BELOW_THE_ARTICLE = {"qwen3-8b-full-4xh100"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="calibrated speed under the article's range"))
        if p.stem in BELOW_THE_ARTICLE
        else p
        for p in ARTICLE
    ],
    ids=lambda p: p.stem,
)
def test_recipe_plans_as_its_header_says(path, no_gpu_here):
    h = header(path)
    assert {"gpus", "engine", "memory_gb", "fits"} <= h.keys(), f"{path.name}: '# expect:' line incomplete"
    recipe = load_recipe(path)
    assert recipe.box in (h["gpus"], f"1x{h['gpus']}"), recipe.box
    assert recipe.method.replace("-", "") in path.stem.replace("-", ""), "name is <model>-<method>[-<box>]"
    assert recipe.tokens == tokens(h.get("tokens", "15M"))
    # The recipe's box is planned with ftrun's Docker image (Unsloth in it), not this machine's software.
    hw, why = this_box.for_plan(None, recipe.box)
    assert hw.source == f"recipe box: {recipe.box}" and "recipe's box" in why
    if h["fits"] == "no":
        with pytest.raises(PlanError) as err:
            plan_mod.make_plan(recipe, hw, tokens=recipe.tokens)
        assert "does not fit" in err.value.message and err.value.fix
        return
    p = plan_mod.make_plan(recipe, hw, tokens=recipe.tokens, box_reason=why)
    # the article's memory table assumes gradient checkpointing; the recipes leave it to the plan, which turns it off
    # where the card holds the activations (launcher/plan/speed.py): the memory is compared as the article counts it
    article = plan_mod.make_plan(
        recipe.model_copy(update={"gradient_checkpointing": True}), hw, tokens=recipe.tokens, box_reason=why
    )
    assert p.fits and p.engine == h["engine"], (p.engine, p.reasons)
    assert p.num_processes == hw.count
    assert any("Docker image" in r for r in p.reasons)
    lo, hi = (float(x) * ARTICLE_GB for x in h["memory_gb"].split("-"))
    total = article.memory["total_gb"]
    assert p.offload_optimizer == ("offload" in h), "DeepSpeed's CPU offload is in the header's expect: line"
    if "offload" in h:
        assert p.offload_params == (h["offload"] == "optimizer+params")
        # The article's figure is the whole job's card memory. CPU offload is chosen because the cards cannot hold
        # that; the job in all (cards + the offloaded states in RAM) still needs at least it (more: fp32 Adam states
        # replace the 8-bit ones under offload).
        cards = p.memory["per_gpu_gb"] * p.num_processes
        assert cards < lo * (1 - MEMORY_SLACK), f"cards hold {cards} GB: the article's {lo}-{hi} GB would fit them"
        assert total >= lo, f"plan {total} GB in all (cards + RAM) vs article {lo}-{hi} GB"
        assert any("nothing else fits" in r for r in p.reasons) and any(
            "8-bit AdamW is not used" in r for r in p.reasons
        ) == (p.method == "full-8bit")
    else:
        assert lo * (1 - MEMORY_SLACK) <= total <= hi * (1 + MEMORY_SLACK), f"plan {total} GB vs article {lo}-{hi} GB"
    assert p.memory["per_gpu_gb"] <= hw.gpu.memory_gb
    if "hours" in h:
        assert p.tokens["training_tokens"] == recipe.tokens
        # the article's used value, or where the speed calibrated on the H200 (docs/sizing.md, "Time and cost") leaves
        # it, the article's range of tokens/s: a measurement beats the article's chosen midpoint
        tps_lo, tps_hi = (float(x) for x in h["tps"].split("-"))
        tps = p.tokens["estimated_tokens_per_second"]
        assert p.estimate["hours"] == pytest.approx(float(h["hours"]), rel=TIME_COST_REL) or tps_lo <= tps <= tps_hi, (
            f"{tps:,.0f} tokens/s: the article used {recipe.tokens / 3600 / float(h['hours']):,.0f} "
            f"({tps_lo:,.0f}-{tps_hi:,.0f})"
        )
        assert p.estimate["cost_eur"] == pytest.approx(p.estimate["hours"] * p.price_per_hour_eur, rel=0.01)


def test_tiny_cpu_vision_recipe_plans_on_a_cpu(tiny_vlm):
    """recipes/tiny-cpu-vision.yaml: image data on the tiny vision-language model, the tower and the images planned."""
    from launcher.data.stats import data_stats, with_data_defaults

    path = RECIPES[0].parent / "tiny-cpu-vision.yaml"
    recipe = load_recipe(path, [f"model={tiny_vlm}"])
    assert "CPU" in header(path)["box_line"] and recipe.box is None
    _, _, stats = data_stats(recipe)
    recipe = with_data_defaults(recipe, stats)
    p = plan_mod.make_plan(recipe, from_spec("cpu"), data_stats=stats)
    assert p.fits and p.device == "cpu" and p.total_steps > 0 and not recipe.padding_free
    assert stats.images["images"] == 128 and any("vision tower and projector" in n for n in p.notes)


def test_tiny_cpu_recipe_plans_on_a_cpu(tiny_model):
    from launcher.data.stats import data_stats

    recipe = load_recipe(RECIPES[0].parent / "tiny-cpu.yaml", [f"model={tiny_model}"])
    assert "CPU" in header(RECIPES[0].parent / "tiny-cpu.yaml")["box_line"] and recipe.box is None
    _, _, stats = data_stats(recipe)
    p = plan_mod.make_plan(recipe, from_spec("cpu"), data_stats=stats)
    assert p.fits and p.device == "cpu" and p.engine == "trl" and p.total_steps > 0


def test_tiny_dpo_recipe_needs_the_sft_demos_adapter_and_plans_on_a_cpu(tiny_model, tmp_path):
    """recipes/tiny-cpu-dpo.yaml continues the SFT demo's adapter: without it, the recipe names init_from and the fix;
    with one (a stand-in adapter of the tiny model here), it plans the pairs on the CPU."""
    from launcher.data.stats import data_stats
    from launcher.errors import RecipeError

    path = RECIPES[0].parent / "tiny-cpu-dpo.yaml"
    with pytest.raises(RecipeError, match="'init_from' = .*does not exist: give the earlier run's directory"):
        load_recipe(path, [f"model={tiny_model}", f"init_from={tmp_path / 'runs' / 'tiny-cpu'}"])
    stand_in_adapter(tmp_path / "runs" / "tiny-cpu", tiny_model)
    recipe = load_recipe(path, [f"model={tiny_model}", f"init_from={tmp_path / 'runs' / 'tiny-cpu'}"])
    _, _, stats = data_stats(recipe)
    p = plan_mod.make_plan(recipe, from_spec("cpu"), data_stats=stats)
    assert p.fits and p.device == "cpu" and p.engine == "trl" and p.total_steps > 0
    assert "reference model" in p.memory["breakdown_gb"] and "LoRA r=8" in p.memory["explanations"]["adapters"]


def test_tiny_grpo_recipe_plans_its_sampling_on_a_cpu_from_the_sft_demos_adapter(tiny_model, tmp_path):
    """recipes/tiny-cpu-grpo.yaml, the demo's third step: prompts with references, the task metric as the reward."""
    from launcher.data.stats import data_stats

    path = RECIPES[0].parent / "tiny-cpu-grpo.yaml"
    stand_in_adapter(tmp_path / "runs" / "tiny-cpu", tiny_model)
    recipe = load_recipe(path, [f"model={tiny_model}", f"init_from={tmp_path / 'runs' / 'tiny-cpu'}"])
    _, _, stats = data_stats(recipe)
    p = plan_mod.make_plan(recipe, from_spec("cpu"), data_stats=stats)
    assert p.fits and p.engine == "trl" and p.total_steps == recipe.max_steps
    assert "generation" in p.memory["breakdown_gb"]
    assert any("each prompt is answered 4 times" in r for r in p.reasons)


@pytest.mark.parametrize("path", ARTICLE, ids=lambda p: p.stem)
def test_header_comment_states_the_article_figures(path):
    text = path.read_text()
    assert re.search(r"# Article, memory table: [\d,]+-[\d,]+ GB", text)
    assert re.search(r"# Article, time table: ", text)
    assert f"# Plan it: ftrun plan recipes/{path.name}" in text  # box: and tokens: make it work as printed


def test_the_headline_recipe_plans_on_a_fresh_clone():
    """`ftrun plan recipes/qwen3-8b-qlora.yaml` as the README's first command runs it: no GPU and no Hub here, so its
    box: is planned with its tokens:, the Hub data named as not read; it fits, and the README leads with it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "plan", str(HEADLINE)],
        capture_output=True,
        text=True,
        env=env,
        cwd=HEADLINE.parents[1],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Plan: qlora of Qwen/Qwen3-8B on 1 x RTX4090" in done.stdout
    assert "data not read here" in done.stdout and "the recipe's tokens:" in done.stdout
    readme = (HEADLINE.parents[1] / "README.md").read_text()
    assert readme.index("ftrun recipes/qwen3-8b-qlora.yaml") < readme.index("recipes/qwen3-8b-qlora-rtx4090.yaml")


class _UnansweringHub:
    """A Hub endpoint on this box that accepts each connection and closes it without a word, counting them."""

    def __init__(self) -> None:
        import socket
        import threading

        self.connections = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._done.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the accept's timeout: look at the flag again
                continue
            self.connections += 1
            conn.close()

    def __enter__(self) -> "_UnansweringHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._sock.close()


def _plan(recipe: Path, env: dict, *args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "plan", str(recipe), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=HEADLINE.parents[1],
        timeout=120,
    )


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "refused", "unanswered"])
def test_the_headline_recipe_plans_at_once_without_the_hub(offline, tmp_path):
    """Offline by setting, or with a Hub that cannot be reached (a refused connection; one closed unanswered): the
    plan answers from the built-in catalog at once, without huggingface_hub's retries (five, 23 s of waiting:
    launcher/hub_access.py), and one line says why. "At once" is counted, not timed: the Hub that closes every
    connection sees exactly one, the probe's (each retry would be one more), and none when the setting says
    offline."""
    import os
    import socket

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "FTRUN_OFFLINE", "HF_ENDPOINT")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    with _UnansweringHub() as hub, socket.socket() as closed:  # bound, never listening: a connection is refused
        closed.bind(("127.0.0.1", 0))
        if offline == "refused":
            env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed.getsockname()[1]}"
        else:
            env["HF_ENDPOINT"] = hub.url
            if offline == "HF_HUB_OFFLINE":
                env["HF_HUB_OFFLINE"] = "1"
        done = _plan(HEADLINE, env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "8.19B params (built-in catalog (qwen3-8b))" in done.stdout
    said = [line for line in done.stdout.splitlines() if "planned offline" in line]
    if offline == "HF_HUB_OFFLINE":
        assert said == [] and "offline (HF_HUB_OFFLINE / FTRUN_OFFLINE)" in done.stdout
        assert hub.connections == 0, out
    else:
        assert len(said) == 1 and f"the Hub at {env['HF_ENDPOINT']} could not be reached" in said[0], out
    if offline == "unanswered":
        assert hub.connections == 1, (hub.connections, out)
