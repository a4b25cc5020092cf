"""Export on CPU with the tiny model: one real run exports adapter and merged model, every output reloaded and
checked. The GGUF (llama.cpp's converter, quantizer and runtime) is tested in tests/deliver/test_gguf.py (-m gguf)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"

pytest.importorskip("matplotlib", reason="the export extra (pip install -e '.[export]') is not installed")


from helpers import export_recipe as write_recipe  # noqa: E402
from helpers import ftrun  # noqa: E402


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """One tiny LoRA run whose recipe asks for the adapter and the merged model; the supervisor exports after
    training."""
    tmp = tmp_path_factory.mktemp("export")
    recipe = write_recipe(tmp / "r.yaml", tiny_model, tmp / "run", export=["adapter", "merged"])
    t0 = time.monotonic()
    res = ftrun(recipe, "--foreground", cwd=tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {
        "run": tmp / "run",
        "cwd": tmp,
        "recipe": recipe,
        "stdout": res.stdout,
        "stderr": res.stderr,
        "seconds": time.monotonic() - t0,
    }


def report(run: Path) -> dict:
    return json.loads((run / "final" / "export.json").read_text())


def test_run_exports_adapter_and_merged_within_tolerance(exported):
    run = exported["run"]
    rep = report(run)
    assert rep["ok"] and rep["formats"] == ["adapter", "merged"]
    out = rep["outputs"]
    # the adapter reloads and moves the base model's output (a trained, non-empty adapter)
    assert out["adapter"]["rank"] == 16 and out["adapter"]["bytes"] > 10_000
    assert out["adapter"]["changes_base_logits"]["mean_kl"] > 0
    merged = out["merged"]["parity_vs_base_plus_adapter"]
    assert merged["ok"] and merged["top1_agreement"] >= 0.98 and merged["greedy_identical"] == "3/3"
    assert merged["positions"] > 100  # three training prompts, teacher-forced
    assert merged["perplexity_reference"] > 1 and abs(merged["perplexity_rel_diff"]) < 0.05
    assert rep["parity_prompts_from"] == "training data (the recipe holds nothing out)"
    state = json.loads((run / "state.json").read_text())
    assert state["state"] == "succeeded" and state["export"]["state"] == "succeeded"


def test_served_prompt_is_the_trained_prompt_in_vllm(exported):
    """Both folders vLLM serves (the base with the adapter's tokenizer, the merged folder) render the prompts to
    the ids training tokenized, and stop on the end of turn the training taught; the log says which runtimes."""
    from launcher.deliver.messages import served_line

    rep = report(exported["run"])
    sp = rep["served_prompt"]
    assert sp["ok"] and sp["checked"] == ["vLLM"] and sp["end_of_turn"]["tokens"] == ["<|im_end|>"]
    # the data's first three conversations (two shapes) and one of each other shape (tiny-chat.jsonl has six)
    assert sp["shapes"]["found"] == sp["shapes"]["checked"] == 6
    for key in ("vllm_adapter", "vllm_merged"):
        assert sp["runtimes"][key]["identical"] == "6/6" and sp["stops"][key]["ok"], key  # 3 first, 3 shapes more
    assert sp["stops"]["vllm_merged"]["generation_config_eos"] == [2, 0]
    assert rep["outputs"]["merged"]["served_prompt"]["ok"] and rep["outputs"]["adapter"]["stops"]["ok"]
    # how often the merged model ends its greedy answer with <|im_end|>: measured, not bounded (8 steps of LoRA
    # on a random tiny model need not have learned it)
    ending = rep["outputs"]["merged"]["ending"]
    assert ending["ended_with_end_of_turn"].endswith("/3") and 0 <= ending["share"] <= 1
    assert len(ending["tokens_run"]) == 3 and all(n >= 1 for n in ending["tokens_run"])
    line = (
        "served prompt = trained prompt (vLLM); not checked: llama-server, llama.cpp, Ollama (no GGUF in this export)"
    )
    log = exported["run"] / "train.log"
    assert served_line(rep) == line and f"[ftrun export] {line}" in exported["stdout"] + (
        log.read_text() if log.is_file() else ""
    )


def test_an_adapter_whose_template_drops_the_end_of_turn_fails_the_export(exported, tmp_path):
    """The exported adapter folder's template differs from training's (it drops <|im_end|>): vLLM would serve
    another prompt, so the export fails (exit 5) with the first differing token, and export.json keeps it."""
    run = tmp_path / "run"
    shutil.copytree(exported["run"], run, ignore=shutil.ignore_patterns("merged", "checkpoints"))
    jinja = run / "final" / "adapter" / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("message['content'] + '<|im_end|>\\n'", "message['content'] + '\\n'"))
    res = ftrun("export", run, cwd=tmp_path)
    assert res.returncode == 5, res.stdout[-2000:] + res.stderr[-2000:]
    assert (
        "vLLM (the base model with the adapter folder's tokenizer) serves another prompt than the training saw"
        in res.stderr
        and "where training had 2 '<|im_end|>'" in res.stderr
        and "Traceback" not in res.stderr
    )
    rep = report(run)
    d = rep["served_prompt"]["runtimes"]["vllm_adapter"]["first_difference"]
    assert rep["ok"] is False and d["trained"]["token"] == "<|im_end|>" and d["context"]
    assert "merged" not in rep["outputs"]  # it failed before merging


def test_qwen3s_template_is_served_with_thinking_off_and_serving_md_says_so(exported, tmp_path):
    """The base model's template is Qwen3's (the headline recipe's family) and the answers trained carry no
    reasoning: training put Qwen3's empty think block in front of every answer, which its generation prompt writes
    only with enable_thinking=false. The export finds that switch, checks vLLM's prompt under it, and every serve
    command passes it."""
    from chat_templates import FAMILIES

    qwen3 = FAMILIES["qwen3"].template
    base = tmp_path / "base"
    shutil.copytree(exported["run"], tmp_path / "run", ignore=shutil.ignore_patterns("merged", "checkpoints"))
    shutil.copytree(Path(yaml_model(exported["recipe"])), base)
    (base / "chat_template.jinja").write_text(qwen3)
    run = tmp_path / "run"
    (run / "final" / "adapter" / "chat_template.jinja").write_text(qwen3)
    recipe = run / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace(str(yaml_model(exported["recipe"])), str(base)))
    res = ftrun("export", run, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = report(run)
    sp = rep["served_prompt"]
    assert sp["ok"] and sp["chat_template_kwargs"] == {"enable_thinking": False}
    assert sp["runtimes"]["vllm_adapter"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert 'served with {"enable_thinking": false}' in res.stdout
    serving = (run / "final" / "SERVING.md").read_text()
    assert serving.count("--default-chat-template-kwargs '{\"enable_thinking\": false}'") == 2  # adapter, merged
    assert "**Serve with the chat-template switch" in serving
    # issue 46: the manual export's lines and the status say what each size counts, as the supervisor's export does
    sizes = [line for line in res.stdout.splitlines() if line.split()[:1] in (["adapter"], ["merged"])]
    assert any(line.endswith("(weights file)") for line in sizes) and any(line.endswith("(folder)") for line in sizes)
    status = ftrun("status", run, cwd=tmp_path).stdout
    assert "weights file, merged " in status and " folder" in status, status


def yaml_model(recipe: Path) -> str:
    import yaml

    return yaml.safe_load(recipe.read_text())["model"]


def test_outputs_reload_on_their_own(exported):
    """Checked here without export.py: the merged folder is plain 16-bit, with its tokenizer and template."""
    final = exported["run"] / "final"
    cfg = json.loads((final / "merged" / "config.json").read_text())
    assert "quantization_config" not in cfg
    with (final / "merged" / "model.safetensors").open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (final / "merged" / name).is_file(), name


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_result_files_are_as_readable_as_the_rest_of_the_run(exported):
    """safetensors writes its files 0600 (launcher/store/modes.py): a server running as another user could not read
    the weights beside a 0644 export.json. Every result has the mode the umask gives a new file, the supervisor's
    export and `ftrun export` alike."""
    from launcher.store.modes import umask

    run = exported["run"]
    final = run / "final"
    want = 0o666 & ~umask()
    assert _mode(final / "export.json") == want
    weights = [
        *final.glob("adapter/*.safetensors"),
        *final.glob("merged/*.safetensors"),
        *run.glob("checkpoints/step-*/*.safetensors"),
    ]
    assert {p.relative_to(run).parts[:2] for p in weights} >= {("final", "adapter"), ("final", "merged")}
    assert any(p.parts[-3] == "checkpoints" for p in weights), "no checkpoint kept to check"
    assert {str(p.relative_to(run)): oct(_mode(p)) for p in weights} == {
        str(p.relative_to(run)): oct(want) for p in weights
    }
    assert _mode(final / "merged") == 0o777 & ~umask()

    # `ftrun export` run by hand: what it leaves in final/ gets the same mode, even when it refuses
    merged = final / "merged" / "model.safetensors"
    merged.chmod(0o600)
    res = ftrun("export", run, "--gguf", "q3_k_s", cwd=exported["cwd"])
    assert res.returncode == 2, res.stderr
    assert _mode(merged) == want


def test_the_merge_line_names_both_dtypes(exported):
    """The merge computes in one dtype and saves in another: the line says both, the saved one as export.json does."""
    rep = report(exported["run"])
    merge = rep["placement"]["merge"]["dtype"]
    assert rep["export_dtype"] == "bfloat16"
    assert (
        f"merging the adapter into the {merge} base; the merged model is saved in bfloat16"
        in exported["stdout"] + exported["stderr"]
    )


def test_the_export_prints_no_loading_bars(exported, tmp_path):
    """transformers draws "Loading weights: 0%|" for each model the export loads, unless its progress bars are off:
    the export turns them off itself, whatever the environment says (the worker's HF_HUB_DISABLE_PROGRESS_BARS
    reaches only the processes it starts)."""
    assert "Loading weights" not in exported["stdout"] + exported["stderr"]
    run = tmp_path / "run"
    shutil.copytree(exported["run"], run, ignore=shutil.ignore_patterns("checkpoints"))  # the fixture's stays as it is
    env = {k: v for k, v in os.environ.items() if not k.endswith("_DISABLE_PROGRESS_BARS")}
    res = subprocess.run(
        [sys.executable, "-m", "launcher.deliver.export", "--run-dir", str(run), "--formats", "adapter"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "loading the base" in res.stdout  # a model was loaded: the bar would have been drawn
    assert "Loading weights" not in res.stdout + res.stderr, res.stderr[-2000:]


def test_no_automatic_model_card_beside_the_checkpoints(exported):
    """TRL writes "fine-tuned version of [None]" into checkpoints/README.md at every save, and PEFT its template
    ("[More Information Needed]") into every adapter folder it saves, unless told not to."""
    checkpoints = exported["run"] / "checkpoints"
    assert list(checkpoints.glob("step-*")), "no checkpoint kept to look beside"
    assert not (checkpoints / "README.md").exists()
    assert not list(checkpoints.glob("step-*/README.md"))
    assert (exported["run"] / "final" / "adapter" / "adapter_config.json").is_file()
    assert not (exported["run"] / "final" / "adapter" / "README.md").exists()


def test_serving_md_and_modelfile_hold_the_commands(exported):
    final = exported["run"] / "final"
    text = (final / "SERVING.md").read_text()
    adapter = final / "adapter"
    assert f"--lora-modules run={adapter}" in text and "--enable-lora" in text
    assert "--max-lora-rank 16" in text and "--max-model-len 256" in text
    assert f"vllm serve {final / 'merged'}" in text and "--served-model-name run" in text
    assert "curl -s http://localhost:8000/v1/chat/completions" in text and '"model": "run"' in text
    # Ollama's own conversion of the merged folder, the alternative it documents
    assert f"printf 'FROM %s\\n' {final / 'merged'} > Modelfile.merged" in text  # the path quoted for the shell
    assert "ollama create run-ollama -q q4_K_M -f Modelfile.merged" in text


def test_loss_png_and_status_show_the_run(exported):
    run = exported["run"]
    png = (run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    res = ftrun("status", run, cwd=exported["cwd"])
    assert res.returncode == 0, res.stderr
    assert "export (adapter, merged): succeeded" in res.stdout and "loss plot:" in res.stdout
    s = json.loads(ftrun("status", run, "--json", cwd=exported["cwd"]).stdout)
    assert s["export"]["state"] == "succeeded" and s["elapsed_seconds"] > 0


@pytest.mark.parametrize("args, needle", [(["--gguf", "q3_k_s"], "unknown GGUF type 'q3_k_s'")])
def test_bad_export_input_is_one_paragraph(exported, args, needle):
    res = ftrun("export", exported["run"], *args, cwd=exported["cwd"])
    assert res.returncode == 2 and needle in res.stderr
    assert "Traceback" not in res.stderr and "Fix:" in res.stderr


def test_export_before_the_run_finished_says_what_to_do(tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recipe = write_recipe(run / "recipe.yaml", tiny_model, run)
    (run / "state.json").write_text(json.dumps({"state": "running", "supervisor_pid": None}))
    res = ftrun("export", run, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "has no final adapter yet" in res.stderr and "Fix:" in res.stderr and "Traceback" not in res.stderr
    assert recipe.is_file()


def test_failed_export_leaves_the_run_trained_not_exported(tiny_model, tmp_path):
    """The supervisor's export step on a run whose adapter is gone: the training stays done, the state says it is
    not exported (not a plain succeeded), the reason is recorded."""
    from launcher.store.rundir import RunDir
    from launcher.store.state import read_state, set_state
    from launcher.run.after_training import _export
    from launcher.recipe_loading import load_recipe

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_recipe(run.recipe, tiny_model, run.root, export=["adapter", "merged"])
    set_state(run, "succeeded", reason="training finished")
    assert _export(load_recipe(run.recipe), run, {"proc": None}) == "trained-not-exported"
    st = read_state(run)
    assert st["state"] == "trained-not-exported" and st["export"]["state"] == "failed"
    assert st["reason"].startswith("trained, not exported: ")
    assert "no final adapter" in st["export"]["reason"] and "ftrun export" in st["export"]["reason"]


def test_parity_outside_tolerance_fails_loudly():
    import torch

    from launcher.deliver.messages import ExportError
    from launcher.deliver.parity import _check, compare

    torch.manual_seed(0)
    a = [{"logits": torch.randn(20, 50), "greedy": [1, 2, 3]}]
    same = compare(a, [{"logits": a[0]["logits"] + 1e-4, "greedy": [1, 2, 3]}], "merged")
    assert same["ok"] and same["top1_agreement"] == 1.0 and same["greedy_identical"] == "1/1"
    bad = compare(a, [{"logits": torch.randn(20, 50), "greedy": [1, 5, 3]}], "merged")
    assert not bad["ok"] and bad["greedy_first_divergence"] == [1]
    with pytest.raises(ExportError, match="does not match its reference"):
        _check("the merged model", bad)


def test_split_rule_and_vllm_rank():
    from launcher.plan.gguf_readiness import KNOWN_SPLITS, split_rule
    from launcher.deliver.serving import vllm_lora_rank

    assert split_rule({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}) == "gpt-2"
    for regex, name in KNOWN_SPLITS.items():
        seq = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}},
                {"type": "ByteLevel", "use_regex": False},
            ],
        }
        assert split_rule({"pre_tokenizer": seq}) == name
    assert split_rule({"pre_tokenizer": {"type": "Metaspace"}}) is None
    assert [vllm_lora_rank(r) for r in (4, 8, 16, 24, 64, 600)] == [8, 8, 16, 32, 64, 512]


def test_modelfile_template_stops_and_tools(tiny_model):
    """The tiny ChatML template becomes a checked Ollama TEMPLATE with its stop tokens; a template with tools or
    thinking is left to the one in the GGUF (a per-role TEMPLATE would drop them)."""
    from transformers import AutoTokenizer

    from launcher.data.dataset import load_examples
    from launcher.deliver.serving import modelfile

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    convs = load_examples(str(TINY_DATA))[:3]
    eos = {tok.convert_tokens_to_ids("<|endoftext|>")}
    mf = modelfile("run-Q4_K_M.gguf", tok, convs, 256, eos_ids=eos)
    ollama = mf["check"].pop("ollama")  # the TEMPLATE is what Ollama renders (launcher/deliver/ollama_template.py)
    assert mf["check"] == {
        "derived": True,
        "tools": False,
        "thinking": False,
        "stop": ["<|im_end|>", "<|endoftext|>"],
        "prompts": 3,
        "identical": 3,
    }
    assert (
        ollama["path"] == "go" and ollama["template_from"] == "the Modelfile's TEMPLATE" and "serve_with" not in ollama
    )
    text = mf["text"]
    assert "FROM ./run-Q4_K_M.gguf" in text and "{{ .Content }}<|im_end|>" in text
    assert 'PARAMETER stop "<|im_end|>"\nPARAMETER stop "<|endoftext|>"' in text and "PARAMETER num_ctx 256" in text
    tok.chat_template = (
        "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
    )
    mf = modelfile("run-Q4_K_M.gguf", tok, convs, 256, eos_ids=eos)
    assert mf["check"]["tools"] and mf["check"]["thinking"] and not mf["check"]["derived"]
    assert not any(line.startswith("TEMPLATE") for line in mf["text"].splitlines())
    assert "# The chat template has tools and thinking" in mf["text"] and mf["check"]["ollama"]["path"] == "native"
    assert 'PARAMETER stop "<|endoftext|>"' in mf["text"]


def test_plot_skips_bad_lines_and_never_raises(tmp_path):
    from launcher.deliver.plots import plot_loss, refresh

    m = tmp_path / "metrics.jsonl"
    m.write_text(
        "".join(json.dumps({"step": i, "loss": 3 - i * 0.1, "learning_rate": 1e-3}) + "\n" for i in range(1, 6))
        + '{"step": 6, "lo'
    )
    out = plot_loss(m, tmp_path / "loss.png")
    assert out and out.read_bytes()[:4] == b"\x89PNG"
    assert refresh(tmp_path / "missing") is None


def test_export_modules_import_light():
    code = (
        "import sys; import launcher.deliver.export, launcher.deliver.plots, launcher.deliver.serving, "
        "launcher.deliver.llamacpp; "
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'gguf', 'peft') if m in sys.modules]; "
        "print(heavy); assert not heavy"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert res.returncode == 0, res.stdout + res.stderr
