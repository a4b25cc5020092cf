"""GGUF export through llama.cpp: its converter, its quantizer, and parity read back in llama.cpp itself.

The tests marked gguf need llama-cpp-python 0.3.36 built from source and its converter installed:
`scripts/test.sh --gguf` does both (about 7 minutes of build on 2 cores, once) and runs `pytest -m gguf`.
Two tiny models: the Qwen3 of scripts/make_tiny_model.py (hidden size 64: rows too short for K-quant blocks
of 256, so Q4_K_M falls back to Q5_0/Q8_0 tensor by tensor, which the test asserts) and a Llama with Llama 3.1's
rope scaling and hidden size 256 (real Q4_K/Q6_K tensors, llama.cpp's rope_freqs). The plan's refusals run in
the default tier (no llama.cpp needed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
gguf_tier = pytest.mark.gguf


from helpers import export_recipe as write_recipe  # noqa: E402
from helpers import ftrun  # noqa: E402


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gguf", REPO / "scripts" / "bench_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def llama_cpp_ready():
    """The tier's premise, failing loudly (not skipping) when the build or the converter is missing."""
    from launcher.plan import gguf_readiness as g

    assert g.runtime_version() == g.PINNED, f"{g.DIST} {g.PINNED} is not installed"
    conv = g.converter()
    assert conv is not None and conv.version == g.PINNED, "ftrun llamacpp install"
    return conv


# ---------------------------------------------------------------------------------------------
# The plan knows before training (default tier: no llama.cpp needed)


def test_plan_refuses_gguf_when_this_box_lacks_llama_cpp(tiny_model, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_model, tmp_path / "run", export=["adapter", "gguf"])
    empty = tmp_path / "no-llama.cpp"
    empty.mkdir()
    res = ftrun("plan", recipe, cwd=tmp_path, env={"FTRUN_LLAMA_CPP": str(empty)}, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "export: gguf (q4_k_m) needs llama.cpp on this box" in res.stderr
    assert "converter is not installed" in res.stderr and "Fix:" in res.stderr and "Traceback" not in res.stderr
    # the plan itself first (it fits: only the export's software is missing), then the blocking problem
    assert "Plan: lora of" in res.stdout and "Memory" in res.stdout and "Time" in res.stdout, res.stdout
    res = ftrun("plan", recipe, "--json", cwd=tmp_path, env={"FTRUN_LLAMA_CPP": str(empty)}, timeout=120)
    plan = json.loads(res.stdout)
    assert res.returncode == 2 and plan["fits"] is True and "needs llama.cpp" in plan["blocked"]["message"], plan
    # planned for another box (--gpus), a missing build here is a note, not a refusal
    res = ftrun("plan", recipe, "--gpus", "1xH100-80GB", cwd=tmp_path, env={"FTRUN_LLAMA_CPP": str(empty)}, timeout=120)
    assert "needs llama.cpp on this box" not in res.stderr
    assert "export gguf q4_k_m:" in res.stdout and "the box that exports" in res.stdout


def test_an_architecture_the_converter_lacks_is_refused_even_where_llama_cpp_is_not(tiny_model, tmp_path):
    """Planning a box to rent on a machine without llama.cpp: the converter's table as ftrun ships it
    (launcher/plan/llamacpp_architectures.json) still refuses the model before any GPU time."""
    model = tmp_path / "opt-like"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["OPTForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    empty = tmp_path / "no-llama.cpp"
    empty.mkdir()
    env = {"FTRUN_LLAMA_CPP": str(empty)}
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "run", export=["adapter", "gguf"])
    res = ftrun("plan", recipe, "--gpus", "1xH100-80GB", cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert (
        "has no conversion for architecture 'OPTForCausalLM'" in res.stderr
        and "llamacpp_architectures.json" in res.stderr
    )
    ok = write_recipe(tmp_path / "ok.yaml", tiny_model, tmp_path / "run2", export=["adapter", "gguf"])
    res = ftrun("plan", ok, "--gpus", "1xH100-80GB", cwd=tmp_path, env=env, timeout=120)
    assert (
        res.returncode == 0
        and "architecture Qwen3ForCausalLM: converted by llama.cpp's conversion/qwen.py" in res.stdout
    )


@gguf_tier
def test_the_shipped_architecture_table_is_the_pinned_converters(llama_cpp_ready):
    from launcher.plan import gguf_readiness

    conv = gguf_readiness.converter()
    assert (
        conv.version
        == gguf_readiness.PINNED
        == json.loads(gguf_readiness.ARCHITECTURES_FILE.read_text())["llama_cpp_python"]
    )
    assert gguf_readiness.shipped_architectures() == gguf_readiness.supported_architectures(conv.folder)


@gguf_tier
def test_plan_refuses_a_model_the_converter_cannot_handle(llama_cpp_ready, tiny_model, tmp_path):
    """Read from the converter's own table: an architecture class it does not list is refused before training."""
    model = tmp_path / "opt-like"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["OPTForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "run", export=["adapter", "gguf"])
    res = ftrun("plan", recipe, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "has no conversion for architecture 'OPTForCausalLM'" in res.stderr and "Traceback" not in res.stderr
    # the same model without gguf plans; the supported one plans with the converter's module named
    plain = write_recipe(tmp_path / "plain.yaml", model, tmp_path / "run", export=["adapter"])
    assert ftrun("plan", plain, cwd=tmp_path, timeout=120).returncode == 0
    ok = ftrun(
        "plan",
        write_recipe(tmp_path / "ok.yaml", tiny_model, tmp_path / "run2", export=["gguf"]),
        cwd=tmp_path,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "architecture Qwen3ForCausalLM: converted by llama.cpp's conversion/qwen.py" in ok.stdout
    assert "its split rule is llama.cpp's 'gpt-2'" in ok.stdout  # the tiny tokenizer is not in llama.cpp's list


# ---------------------------------------------------------------------------------------------
# The tiny Qwen3, trained and exported by the supervisor


@pytest.fixture(scope="module")
def qwen_run(llama_cpp_ready, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    recipe = write_recipe(tmp / "r.yaml", tiny_model, tmp / "run", export=["adapter", "merged", "gguf"])
    res = ftrun(recipe, "--foreground", cwd=tmp, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {"run": tmp / "run", "cwd": tmp, "stdout": res.stdout}


def _checked(run: Path) -> str:
    """ "n/n": the served-prompt checks' prompts (three held out, one of each other shape)."""
    n = len(json.loads((run / "final" / "export.json").read_text())["served_prompt"]["shapes"]["each"])
    ids = _report(run)["served_prompt"]["runtimes"]["vllm_merged"]["identical"]
    assert ids.split("/")[0] == ids.split("/")[1] and int(ids.split("/")[0]) >= n
    return ids


def _report(run: Path) -> dict:
    return json.loads((run / "final" / "export.json").read_text())


@gguf_tier
def test_q4_k_m_made_by_llama_cpp_and_checked_in_llama_cpp(qwen_run):
    run = qwen_run["run"]
    rep = _report(run)
    assert rep["ok"], rep.get("error")
    g = rep["outputs"]["gguf"]
    assert g["type"] == "Q4_K_M" and g["architecture"] == "qwen3" and g["path"].endswith("run-Q4_K_M.gguf")
    assert "llama-cpp-python 0.3.36" in g["written_by"] and "quantizer" in g["written_by"]
    # hidden size 64 and intermediate 128: no row holds a 256-value K block, so llama.cpp falls back per tensor
    assert not {"Q4_K", "Q5_K", "Q6_K"} & set(g["tensor_types"]) and {"Q5_0", "F32"} <= set(g["tensor_types"])
    assert g["tokenizer_pre"] == "gpt-2" and g["tokenizer_identical"] == "3/3"
    assert g["chat_template_included"] and g["config_differences"] == []
    par = g["parity_vs_merged"]
    assert par["ok"] and par["positions"] > 100 and par["tolerance"]["min_top1"] <= par["top1_agreement"]
    assert abs(par["perplexity_rel_diff"]) <= par["tolerance"]["max_ppl"]
    # both steps ran in their own processes and streamed: peak RSS measured, the 16-bit intermediate removed
    assert g["steps"]["convert"]["peak_rss_bytes"] > 0 and g["steps"]["quantize"]["peak_rss_bytes"] > 0
    assert [p.name for p in (run / "final" / "gguf").iterdir()] == ["Modelfile", "run-Q4_K_M.gguf"] or sorted(
        p.name for p in (run / "final" / "gguf").iterdir()
    ) == ["Modelfile", "run-Q4_K_M.gguf"]
    state = json.loads((run / "state.json").read_text())
    assert state["state"] == "succeeded" and state["export"]["state"] == "succeeded"


@gguf_tier
def test_the_task_is_scored_on_every_export_the_served_gguf_included(qwen_run, tmp_path):
    """A copy of the run with a task of 20 of its conversations (RUN/task.json, as the worker writes it) exported
    again: the merged folder (transformers, its own tokenizer) and the Q4_K_M file as llama-server serves it answer
    the same prompts; their scores join the fine-tuned model's in final/task_eval.json and samples.md, and the
    export says each."""
    import shutil

    from launcher.data.task_examples import build_task
    from launcher.data.dataset import load_data
    from launcher.recipe_loading import load_recipe
    from launcher.store.checkpoint import atomic_write_json
    from launcher.data.task_verdict import FINE_TUNED
    from launcher.worker import task_eval

    run = tmp_path / "run"
    shutil.copytree(qwen_run["run"], run, ignore=shutil.ignore_patterns("checkpoints", "merged", "gguf"))
    recipe = load_recipe(run / "recipe.yaml")
    examples = load_data(recipe.data, recipe.seed).examples
    task = build_task(examples, list(range(20)), list(range(20, len(examples))), recipe.eval.task, recipe.seed)
    atomic_write_json(run / "task.json", task)
    task_eval.record(
        run, task, FINE_TUNED, {"score": 0.5, "details": {}, "seconds": 1.0, "new_tokens": 10, "tokens_per_s": 10.0}
    )
    res = ftrun("export", run, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((run / "final" / "task_eval.json").read_text())
    assert out["examples"] == 20 and out["metric"] == "text" and out["verdict"]
    assert set(out["scores"]) == {"fine_tuned", "merged", "gguf-q4_k_m"}
    assert all(0 <= v <= 1 for v in out["scores"].values())
    gen = out["generation"]["gguf-q4_k_m"]
    assert gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0
    assert len((run / "task_eval" / "merged.jsonl").read_text().splitlines()) == 20
    assert "[ftrun export] task eval: gguf-q4_k_m " in res.stdout and "[ftrun export] task eval: merged " in res.stdout
    assert "(fine-tuned 50.0%)" in res.stdout
    assert "| gguf-q4_k_m |" in (run / "final" / "samples.md").read_text()


@gguf_tier
def test_modelfile_and_serving_md_for_ollama(qwen_run):
    final = qwen_run["run"] / "final"
    modelfile = (final / "gguf" / "Modelfile").read_text()
    assert "FROM ./run-Q4_K_M.gguf" in modelfile and "{{ .Content }}<|im_end|>" in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and 'PARAMETER stop "<|endoftext|>"' in modelfile
    text = (final / "SERVING.md").read_text()
    assert "ollama create run -f Modelfile" in text and "ollama run run " in text
    assert "ollama create run-ollama -q q4_K_M -f Modelfile.merged" in text
    assert "made by llama.cpp's converter and quantizer and read back in llama.cpp" in text


@gguf_tier
def test_served_prompt_is_the_trained_prompt_in_llama_cpp_and_ollama(qwen_run):
    """The GGUF's own template (llama-cpp-python's chat formatter) and the Modelfile's TEMPLATE (rendered as Ollama
    renders it) give the ids training tokenized; every runtime stops on <|im_end|>; the chat completion answers a
    held-out prompt with llama.cpp's greedy continuation of it."""
    from launcher.deliver.messages import served_line

    rep = _report(qwen_run["run"])
    sp, g = rep["served_prompt"], rep["outputs"]["gguf"]
    assert sp["ok"] and sp["checked"] == ["vLLM", "llama-server", "llama.cpp", "Ollama"]
    for key in ("vllm_adapter", "vllm_merged", "llama_server", "llama_cpp", "ollama"):
        assert sp["runtimes"][key]["identical"] == _checked(qwen_run["run"]), key  # three held out, the other shapes
    for key in ("vllm_adapter", "vllm_merged", "llama_cpp", "ollama"):
        assert sp["stops"][key]["ok"], key
    # llama-server tokenizes with the vocabulary's specials: this GGUF adds neither BOS nor EOS
    assert sp["runtimes"]["llama_server"]["adds_bos"] is False and sp["runtimes"]["llama_server"]["adds_eos"] is False
    assert 2 in sp["stops"]["llama_cpp"]["end_of_generation_ids"] and sp["stops"]["ollama"]["stop"][0] == "<|im_end|>"
    assert g["modelfile_served_prompt"]["ok"] and g["ending"]["ended_with_end_of_turn"].endswith("/3")
    smoke = g["serving_smoke"]
    assert smoke["ok"] and smoke["prompt_is_trained_prompt"] and smoke["same_as_llama_cpp_greedy"]
    assert (
        0 < smoke["seconds"] < 60 and 1 <= len(smoke["tokens"]) <= 16 and smoke["finish_reason"] in ("stop", "length")
    )
    assert served_line(rep) == "served prompt = trained prompt (vLLM, llama-server, llama.cpp, Ollama)"


@gguf_tier
def test_a_gguf_whose_embedded_template_differs_fails_with_the_first_differing_token(
    qwen_run, llama_cpp_ready, tmp_path
):
    """The same file with another chat template (written by gguf-py's gguf_new_metadata, the end of turn dropped):
    llama.cpp renders another prompt than training's, and the check names the token."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from launcher import gguf_types
    from launcher.deliver import gguf_export, llamacpp_runtime
    from launcher.deliver.messages import ExportError
    from launcher.deliver.parity import parity_prompts
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    run = qwen_run["run"]
    good = run / "final" / "gguf" / "run-Q4_K_M.gguf"
    bad = tmp_path / "bad.gguf"
    tok = AutoTokenizer.from_pretrained(str(run / "final" / "merged"))
    template = tok.chat_template.replace("message['content'] + '<|im_end|>\\n'", "message['content'] + '\\n'")
    assert template != tok.chat_template
    script = llama_cpp_ready.folder / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"
    res = subprocess.run(
        [sys.executable, str(script), str(good), str(bad), "--chat-template", template, "--force"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(llama_cpp_ready.folder / "gguf-py")},
    )
    assert res.returncode == 0 and bad.is_file(), res.stderr[-2000:]
    recipe = load_recipe(run / "recipe.yaml")
    served = ServedPrompt(recipe, run / "final" / "adapter", 3)
    prompts = parity_prompts(recipe, tok)
    for path, fails in ((good, False), (bad, True)):
        r = llamacpp_runtime.run_gguf(path, prompts, 16, {0, 2}, chat=served.prompts)
        out = {"path": str(path)}
        if not fails:
            gguf_export._served_checks(served, r, out, {}, [], gguf_types.TYPES["q4_k_m"], None)
            assert served.report["runtimes"]["llama_cpp"]["identical"] == _checked(run)
            assert served.report["runtimes"]["llama_server"]["identical"] == _checked(run)
            continue
        with pytest.raises(
            ExportError,
            match=r"^llama-server --jinja with bad.gguf .*serves another prompt than the "
            r"training saw .* where training had 2 '<\|im_end\|>'",
        ):
            gguf_export._served_checks(served, r, out, {}, [], gguf_types.TYPES["q4_k_m"], None)
        d = served.report["runtimes"]["llama_server"]["first_difference"]
        assert d["served"]["token"] == "Ċ" and d["context"]


@gguf_tier
def test_a_gguf_whose_vocabulary_adds_eos_fails_in_llama_server_naming_the_eos(qwen_run):
    """tokenizer.ggml.add_eos_token=true (a tokenizer whose post-processor appends EOS, as converted): llama-server
    tokenizes the chat prompt with the vocabulary's specials (server-context.cpp handle_completions_impl), so every
    prompt ends in EOS where training had the end of the prompt; llama-cpp-python's chat completion does not add
    it. The check refuses, names the EOS, and says which flag serves the trained prompt."""
    from transformers import AutoTokenizer

    from launcher import gguf_types
    from launcher.deliver import gguf_export, llamacpp_runtime
    from launcher.deliver.messages import ExportError
    from launcher.deliver.parity import parity_prompts
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    run = qwen_run["run"]
    path = run / "final" / "gguf" / "run-Q4_K_M.gguf"
    recipe = load_recipe(run / "recipe.yaml")
    served = ServedPrompt(recipe, run / "final" / "adapter", 3)
    prompts = parity_prompts(recipe, AutoTokenizer.from_pretrained(str(run / "final" / "merged")))
    r = llamacpp_runtime.run_gguf(
        path, prompts, 16, {0, 2}, chat=served.prompts, overrides={"tokenizer.ggml.add_eos_token": True}
    )
    assert r["adds"] == {"bos": False, "eos": True}
    assert all(c["ids"] == s["ids"][:-1] for c, s in zip(r["chat"], r["server"]))  # the same prompt, and an EOS
    with pytest.raises(ExportError) as err:
        gguf_export._served_checks(served, r, {"path": str(path)}, {}, [], gguf_types.TYPES["q4_k_m"], None)
    eos = r["bos_eos"]["eos"]
    assert f"it has {eos} " in err.value.message and "where training had the answer" in err.value.message
    assert "--override-kv tokenizer.ggml.add_eos_token=bool:false" in err.value.fix


@gguf_tier
def test_qwen3_thinking_off_is_served_by_llama_server_with_the_switch(qwen_run, llama_cpp_ready, tmp_path):
    """The same GGUF carrying Qwen3's real template, the base model's too: training (answers without reasoning)
    put the empty think block in front of every answer; llama-server renders it with enable_thinking=false
    (--chat-template-kwargs), and llama-cpp-python, which takes no switches, is not compared and runs no smoke test."""
    import shutil
    import subprocess
    import sys

    import yaml
    from transformers import AutoTokenizer

    from chat_templates import FAMILIES
    from launcher import gguf_types
    from launcher.deliver import gguf_export, llamacpp_runtime
    from launcher.deliver.parity import parity_prompts
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    run = qwen_run["run"]
    qwen3 = FAMILIES["qwen3"].template
    base = tmp_path / "base"
    cfg = yaml.safe_load((run / "recipe.yaml").read_text())
    shutil.copytree(cfg["model"], base)
    (base / "chat_template.jinja").write_text(qwen3)
    cfg["model"] = str(base)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    recipe = load_recipe(tmp_path / "r.yaml")
    served = ServedPrompt(recipe, base, 3)
    assert served.kwargs == {"enable_thinking": False}
    gguf = tmp_path / "qwen3.gguf"
    script = llama_cpp_ready.folder / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            str(run / "final" / "gguf" / "run-Q4_K_M.gguf"),
            str(gguf),
            "--chat-template",
            qwen3,
            "--force",
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(llama_cpp_ready.folder / "gguf-py")},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(str(base))
    r = llamacpp_runtime.run_gguf(
        gguf,
        parity_prompts(recipe, tok, kwargs=served.kwargs),
        16,
        {0, 2},
        chat=served.prompts,
        template_kwargs=served.kwargs,
    )
    assert r["server"][0]["text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not r["chat"][0]["text"].endswith("</think>\n\n")  # llama-cpp-python: the template's default
    gguf_export._served_checks(served, r, {"path": str(gguf)}, {}, [], gguf_types.TYPES["q4_k_m"], None)
    rt = served.report["runtimes"]
    n = len(served.prompts)
    assert rt["llama_server"]["identical"] == f"{n}/{n}" and rt["llama_cpp"]["identical"] is None
    assert "takes no chat-template switches" in rt["llama_cpp"]["note"]
    assert served.report["checked"] == ["llama-server"]


@gguf_tier
def test_a_modelfile_with_a_wrong_stop_or_template_fails(qwen_run):
    """Ollama would not stop on a Modelfile whose only stop is another model's ("</s>"), and would render another
    prompt from a TEMPLATE without the end of turn: both fail the check."""
    from launcher.deliver import export_serving
    from launcher.deliver.messages import ExportError
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    run = qwen_run["run"]
    text = (run / "final" / "gguf" / "Modelfile").read_text()
    g = {"path": str(run / "final" / "gguf" / "run-Q4_K_M.gguf")}
    served = ServedPrompt(load_recipe(run / "recipe.yaml"), run / "final" / "adapter", 3)
    export_serving._served_modelfile(served, g, text)  # the real one passes
    assert g["modelfile_served_prompt"]["identical"] == _checked(run) and g["modelfile_stops"]["ok"]
    wrong_stop = (
        "\n".join(l for l in text.splitlines() if not l.startswith("PARAMETER stop")) + '\nPARAMETER stop "</s>"\n'
    )
    with pytest.raises(ExportError, match=r"Ollama with this Modelfile \(PARAMETER stop\) does not stop on the token"):
        export_serving._served_modelfile(served, g, wrong_stop)
    stops = served.report["stops"]["ollama"]
    assert stops["ok"] is False and stops["stop"] == ["</s>"] and stops["end_of_turn_text"] == {"2": "<|im_end|>"}
    wrong_template = text.replace("{{ .Content }}<|im_end|>", "{{ .Content }}")
    with pytest.raises(ExportError, match=r"Ollama \(the Modelfile's TEMPLATE\) serves another prompt"):
        export_serving._served_modelfile(served, g, wrong_template)


@gguf_tier
def test_ftrun_export_q8_0_from_the_same_run(qwen_run):
    run = qwen_run["run"]
    res = ftrun("export", run, "--gguf", "q8_0", cwd=qwen_run["cwd"], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "run-Q8_0.gguf" in res.stdout
    g = _report(run)["outputs"]["gguf"]
    assert g["type"] == "Q8_0" and g["tensor_types"].keys() <= {"Q8_0", "F32"}
    assert g["parity_vs_merged"]["ok"] and g["tokenizer_identical"] == "3/3"
    assert json.loads((run / "state.json").read_text())["state"] == "succeeded"


@gguf_tier
def test_f32_serving_smoke_answers_the_merged_models_greedy_continuation(qwen_run):
    """An F32 file holds the merged weights: llama-cpp-python's chat completion answers the held-out prompt with the
    merged model's own greedy tokens (transformers), not only llama.cpp's; its time is in export.json."""
    run = qwen_run["run"]
    res = ftrun("export", run, "--gguf", "f32", cwd=qwen_run["cwd"], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = _report(run)
    smoke = rep["outputs"]["gguf"]["serving_smoke"]
    assert smoke["ok"] and smoke["same_as_merged_greedy"] and smoke["same_as_llama_cpp_greedy"]
    assert smoke["must_equal"] == "the merged model's and llama.cpp's greedy continuation" and smoke["seconds"] > 0
    assert "served prompt = trained prompt (vLLM, llama-server, llama.cpp, Ollama)" in res.stdout


@gguf_tier
def test_a_gguf_that_fails_its_check_leaves_the_run_trained_not_exported(qwen_run, monkeypatch):
    """A check that fails (here: a bound no file can meet) is in export.json, status and state."""
    from launcher.deliver import export, parity
    from launcher.run.after_training import export_command
    from launcher.store.rundir import RunDir

    run = qwen_run["run"]
    monkeypatch.setitem(
        parity.TOLERANCE, "gguf:q8_0", {"max_kl": 0.0, "min_top1": 1.01, "max_ppl": 0.0, "min_greedy": 1.0}
    )
    monkeypatch.chdir(qwen_run["cwd"])
    with pytest.raises(export.ExportError, match=r"does not match its reference.*top-1 agreement"):
        export_command(RunDir(Path(run).resolve()), gguf="q8_0")
    rep = _report(run)
    assert rep["ok"] is False and rep["outputs"]["gguf"]["parity_vs_merged"]["ok"] is False
    assert (
        "does not match its reference" in rep["outputs"]["gguf"]["error"]
        and "mean KL divergence" in rep["outputs"]["gguf"]["error"]
    )
    state = json.loads((run / "state.json").read_text())
    assert state["state"] == "trained-not-exported" and state["export"]["state"] == "failed"
    res = ftrun("status", run, cwd=qwen_run["cwd"], timeout=120)
    assert "trained-not-exported" in res.stdout and "failed" in res.stdout


# ---------------------------------------------------------------------------------------------
# A second architecture: Llama with Llama 3.1's rope scaling, rows long enough for K-quants


@gguf_tier
def test_tiny_llama31_converts_quantizes_and_matches_in_llama_cpp(llama_cpp_ready, tmp_path_factory):
    from launcher.deliver import gguf_export
    from launcher.deliver import llamacpp_runtime, llamacpp_steps
    from launcher.deliver.serving import modelfile
    from launcher.plan import gguf_readiness

    bench = _bench()
    out = tmp_path_factory.mktemp("llama31")
    model = bench.build_tiny_llama(out / "model")
    assert json.loads((model / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    ready = gguf_readiness.readiness(str(model), "q4_k_m")
    assert ready.ok and ready.facts["tokenizer"]["pre"] == "llama-bpe", ready.problems
    tok, prompts, ref = bench.reference(model)
    sixteen = out / "tiny-BF16.gguf"
    llamacpp_steps.convert(llama_cpp_ready, model, sixteen, "bf16")
    results = {
        t: gguf_export.gguf_output(model, out / "gguf", "tiny", t, prompts, ref, tok, intermediate=sixteen)
        for t in ("q4_k_m", "q8_0")
    }
    q4, q8 = results["q4_k_m"], results["q8_0"]
    assert {"Q4_K", "Q6_K"} <= set(q4["tensor_types"]) and "Q8_0" in q8["tensor_types"]
    for r in results.values():
        assert r["architecture"] == "llama" and r["tokenizer_pre"] == "llama-bpe"
        assert r["config_differences"] == [] and r["tokenizer_identical"] == "3/3"
        assert r["parity_vs_merged"]["ok"], r["parity_vs_merged"]
    assert "rope_freqs.weight" in llamacpp_runtime.metadata(Path(q4["path"]))["tensor_names"]
    assert q4["bytes"] < q8["bytes"] < sixteen.stat().st_size
    # a K-quant rounds more than Q8_0: its logits move further from the model's
    assert q4["parity_vs_merged"]["mean_kl"] > q8["parity_vs_merged"]["mean_kl"]
    # its template has tools and thinking: the Modelfile leaves the template to the one in the GGUF
    mf = modelfile(Path(q4["path"]).name, tok, [], 256, eos_ids=gguf_export._stop_ids(model, tok))
    assert mf["check"]["tools"] and mf["check"]["thinking"]
    assert not any(line.startswith("TEMPLATE") for line in mf["text"].splitlines())
    assert 'PARAMETER stop "<|im_end|>"' in mf["text"]
