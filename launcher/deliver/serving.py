"""The serving commands for an exported run: SERVING.md (vLLM with the adapter or the merged model, curl, Ollama) and
the Ollama Modelfile."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Optional

from launcher.deliver.go_template import render as render_go
from launcher.methods import is_quantized

# vLLM accepts only these values for --max-lora-rank (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_SENTINELS = {"system": "QQSYSTEMQQ", "user": "QQUSERQQ", "assistant": "QQASSISTANTQQ", "user2": "QQSECONDQQ"}


def fence(*lines: str, lang: str = "") -> list[str]:
    """A markdown code block of `lines`, and the blank line after it."""
    return [f"```{lang}", *lines, "```", ""]


def vllm_lora_rank(r: int) -> int:
    return next((v for v in VLLM_LORA_RANKS if v >= r), VLLM_LORA_RANKS[-1])


def served_name(run_root: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", run_root.name).strip("-").lower() or "model"


def template_switches(report: dict[str, Any]) -> dict[str, Any]:
    """The chat-template switches the trained prompt needs (export.json served_prompt), {} for the defaults."""
    return dict((report.get("served_prompt") or {}).get("chat_template_kwargs") or {})


def vllm_command(
    model: str,
    *,
    lora_module: Optional[str] = None,
    lora_rank: Optional[int] = None,
    name: Optional[str] = None,
    max_model_len: Optional[int] = None,
    quote: bool = True,
    breaks: bool = False,
    switches: Optional[dict[str, Any]] = None,
) -> str:
    """The one spelling of vLLM's serve command: `model`, or the base with a LoRA adapter (`lora_module` NAME=PATH);
    `switches`: the chat-template kwargs (vLLM 0.34 `--default-chat-template-kwargs`,
    vllm/entrypoints/common/cli_args.py); `quote`: shell-quoted; `breaks`: an option a line."""
    words = [["vllm", "serve", model]]
    if lora_module is not None:
        words += [
            ["--enable-lora"],
            ["--lora-modules", lora_module],
            ["--max-lora-rank", str(vllm_lora_rank(lora_rank))],
        ]
    if name is not None:
        words += [["--served-model-name", name]]
    if max_model_len is not None:
        words += [["--max-model-len", str(max_model_len)]]
    sep = " \\\n  " if breaks else " "
    text = sep.join(" ".join(shlex.quote(w) if quote else w for w in option) for option in words)
    if switches:  # JSON: quoted for the shell even where the rest is shown as written
        text += sep + "--default-chat-template-kwargs " + shlex.quote(json.dumps(switches))
    return text


# ---------------------------------------------------------------------------------------------
# The chat template as an Ollama (Go) template: derived from the Jinja one, then checked against it


def _render(tokenizer, messages: list[dict[str, str]], gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def derive_pieces(tokenizer) -> Optional[dict[str, str]]:
    """Per-role text before/after a message's content, and the generation prompt; None if not uniform."""
    s, u, a, u2 = (_SENTINELS[k] for k in ("system", "user", "assistant", "user2"))
    try:
        only_user = _render(tokenizer, [{"role": "user", "content": u}], True)
        sys_user = _render(tokenizer, [{"role": "system", "content": s}, {"role": "user", "content": u}], True)
        two_users = _render(tokenizer, [{"role": "user", "content": u}, {"role": "user", "content": u2}], False)
        with_asst = _render(tokenizer, [{"role": "user", "content": u}, {"role": "assistant", "content": a}], False)
    except Exception:  # a template that refuses these shapes (e.g. strict role alternation): no derived template
        return None
    try:
        u_pre, after_u = only_user.split(u)
        s_pre, rest = sys_user.split(s)
        s_post = rest.split(u)[0]
        if not s_post.endswith(u_pre):
            return None
        s_post = s_post[: len(s_post) - len(u_pre)] if u_pre else s_post
        between = two_users.split(u)[1].split(u2)[0]
        if not between.endswith(u_pre):
            return None
        u_post = between[: len(between) - len(u_pre)] if u_pre else between
        if not after_u.startswith(u_post):
            return None
        gen = after_u[len(u_post) :]
        a_pre, a_post = with_asst.split(u)[1].split(a)
        if not a_pre.startswith(u_post):
            return None
        a_pre = a_pre[len(u_post) :]
    except ValueError:  # a sentinel missing or repeated: the template rewrites content
        return None
    return {
        "system_pre": s_pre,
        "system_post": s_post,
        "user_pre": u_pre,
        "user_post": u_post,
        "assistant_pre": a_pre,
        "assistant_post": a_post,
        "generation": gen,
    }


def go_template(pieces: dict[str, str]) -> str:
    # One line, no {{- trim markers: a trim marker would eat the newlines that belong to the pieces.
    def branch(role: str) -> str:
        return f'eq .Role "{role}" }}}}{pieces[role + "_pre"]}{{{{ .Content }}}}{pieces[role + "_post"]}'

    roles = "{{ else if ".join(branch(role) for role in ("system", "user", "assistant"))
    return "{{ range .Messages }}{{ if " + roles + "{{ end }}{{ end }}" + pieces["generation"]


def template_features(template: str) -> dict[str, bool]:
    """Whether a Jinja chat template takes tools and has a thinking mode (as Qwen3 and Llama 3.1's do)."""
    return {
        "tools": bool(re.search(r"\btools\b", template)),
        "thinking": any(k in template for k in ("enable_thinking", "<think>", "reasoning_content")),
    }


def stop_tokens(tokenizer, eos_ids: set[int], pieces: Optional[dict[str, str]]) -> list[str]:
    """What ends a reply: the text after an assistant message in the template, and the model's end tokens."""
    after = [pieces["assistant_post"].strip()] if pieces is not None else []
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in sorted(eos_ids)]
    return list(dict.fromkeys(t for t in after + tokens if t))


def _prompt_of(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last = max((i for i, m in enumerate(conv) if m["role"] == "assistant"), default=len(conv))
    return conv[:last] or conv[:1]


def ollama_default(
    tokenizer, written: Optional[str], conversations: list[list[dict[str, Any]]], architecture: Optional[str] = None
) -> dict[str, Any]:
    """How Ollama, as installed, renders these prompts for the GGUF with the Modelfile TEMPLATE `written`
    (ollama_template.choose), and, where a Go template renders them otherwise than the model's own, the setting
    that serves the GGUF's own template instead (`serve_with`)."""
    from launcher.deliver.go_template import Unsupported
    from launcher.deliver.ollama_template import GO_TEMPLATE_ENV, choose, source

    gguf_template = tokenizer.chat_template or ""
    choice = choose(gguf_template, written, architecture)
    out = {"path": choice["path"], "why": choice["why"], "ollama": source()["tag"]}
    if choice["path"] != "go":
        return out
    differ = []
    for conv in conversations:
        prompt = _prompt_of(conv)
        try:
            same = render_go(choice["template"], prompt) == _render(tokenizer, prompt, True)
        except Unsupported as exc:
            return dict(out, path="not modelled", why=f"{choice['from']}: {exc} is beyond what ftrun renders")
        if not same:
            differ.append(",".join(m["role"] for m in prompt))
    out.update(template_from=choice["from"], identical=f"{len(conversations) - len(differ)}/{len(conversations)}")
    if differ:
        out["differs_for"] = list(dict.fromkeys(differ))[:5]  # the conversation shapes, each once
        if choose(gguf_template, written, architecture, go_template_env=False)["path"] == "native":
            out["serve_with"] = {GO_TEMPLATE_ENV: "0"}
    return out


def _ollama_comment(default: dict[str, Any]) -> list[str]:
    """The Modelfile's comment on the template Ollama renders without a TEMPLATE line."""
    if default.get("serve_with"):
        return [
            f"# Ollama {default['ollama']} would render {default['template_from']}, which writes some prompts "
            "otherwise than the model's",
            "# own template (roles " + "; ".join(default["differs_for"]) + "). "
            "Start `ollama serve` with OLLAMA_GO_TEMPLATE=0 (SERVING.md): it then renders the",
            "# GGUF's own chat template through llama-server, the messages one to one.",
        ]
    if default["path"] == "native":
        return ["# Ollama renders the GGUF's own chat template (tokenizer.chat_template) through llama-server."]
    return [f"# Which template Ollama renders here is not modelled by ftrun: {default['why']}."]


def modelfile(
    gguf_name: str,
    tokenizer,
    conversations: list[list[dict[str, str]]],
    num_ctx: int,
    eos_ids: Optional[set[int]] = None,
    architecture: Optional[str] = None,
) -> dict[str, Any]:
    """The Modelfile text, and whether its template reproduces the Jinja template on the parity prompts. A template
    uniform per role becomes an Ollama TEMPLATE, checked on the prompts; not one with tools or thinking (a per-role
    TEMPLATE drops them), nor where Ollama's merging of consecutive same-role messages (template/template.go
    collate) renders otherwise. Without one, `check["ollama"]` says what Ollama renders (ollama_default)."""
    template = tokenizer.chat_template or ""
    features = template_features(template)
    pieces = None if (features["tools"] or features["thinking"]) else derive_pieces(tokenizer)
    stops = stop_tokens(tokenizer, eos_ids or set(), pieces)
    lines = ["# Written by ftrun export. From this folder: ollama create NAME -f Modelfile", f"FROM ./{gguf_name}"]
    check: dict[str, Any] = {"derived": pieces is not None, **features, "stop": stops}
    written = None
    if pieces is not None:
        same = 0
        for conv in conversations:
            prompt = _prompt_of(conv)
            if render_go(go_template(pieces), prompt) == _render(tokenizer, prompt, True):
                same += 1
            else:
                check.setdefault("differs_for", []).append(",".join(m["role"] for m in prompt))
        check.update(prompts=len(conversations), identical=same)
        if same == len(conversations) and '"""' not in go_template(pieces):
            written = go_template(pieces)
        else:
            check["note"] = (
                "the derived template renders some conversations otherwise than the Jinja one (roles "
                + "; ".join(check.get("differs_for", [])[:3])
                + "): Ollama merges consecutive messages "
                "of one role before a Go template renders them, so no TEMPLATE is written"
            )
            lines.insert(
                1,
                "# No TEMPLATE here: Ollama merges consecutive messages of one role before any Go "
                "template renders them, so none renders every conversation of the data as the model's own.",
            )
    elif features["tools"] or features["thinking"]:
        has = " and ".join(k for k in ("tools", "thinking") if features[k])
        lines.insert(1, f"# The chat template has {has}: no TEMPLATE here, a per-role one would drop them.")
        check["note"] = f"the template has {has}: no TEMPLATE written"
    else:
        check["note"] = "the Jinja template is not uniform per role: no TEMPLATE written"
    check["ollama"] = ollama_default(tokenizer, written, conversations, architecture)
    if written is not None:
        lines.append(f'TEMPLATE """{written}"""')
    else:
        lines[2:2] = _ollama_comment(check["ollama"])
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    lines.append(f"PARAMETER num_ctx {num_ctx}")
    return {"text": "\n".join(lines) + "\n", "check": check}


# ---------------------------------------------------------------------------------------------
# SERVING.md


def _go_template_off(default: dict[str, Any]) -> list[str]:
    """SERVING.md's lines that start `ollama serve` (which reads envconfig.GoTemplate) with ollama_default's
    serve_with."""
    env = default.get("serve_with")
    if not env:
        return []
    ((key, value),) = env.items()
    return [
        f"**Start Ollama with `{key}={value}`.** For this GGUF Ollama {default['ollama']} stores "
        f"{default['template_from']}; rendered as Ollama renders a Go template (consecutive messages of one role "
        "merged), it writes some of the checked prompts otherwise than training did (roles "
        + "; ".join(default["differs_for"])
        + "). With the setting, the server renders the GGUF's own template "
        "through llama-server, one message per turn, the prompt llama-server's check compared token for token "
        "(export.json served_prompt.runtimes.ollama). It applies to every model that server serves, and a "
        "Modelfile TEMPLATE is then ignored.",
        "",
        *fence(
            f"{key}={value} ollama serve",
            "# or, for Ollama as a systemd service (the Linux installer's):",
            f'sudo systemctl edit ollama.service   # add under [Service]: Environment="{key}={value}"',
            "sudo systemctl restart ollama",
        ),
    ]


def _curl(name: str, content: str, port: int = 8000) -> str:
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": content}], "max_tokens": 256, "temperature": 0},
        ensure_ascii=False,
    )
    return (
        f"curl -s http://localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(body)}"
    )


def render(
    run,
    recipe,
    report: dict[str, Any],
    tokenizer,
    eos_ids: Optional[set[int]] = None,
    prompts: Optional[list[list[dict[str, Any]]]] = None,
) -> tuple[str, Optional[dict[str, Any]]]:
    """(SERVING.md text, Modelfile or None) for what export produced; `prompts`: the conversations an Ollama template
    must render as the model's own (the served-prompt checks'), else the data's first three."""
    from launcher.data.dataset import load_examples

    outputs = report["outputs"]
    name = served_name(run.root)
    convs = load_examples(recipe.data)[:3]
    question = next((m["content"] for m in convs[0] if m["role"] == "user"), "Hello") if convs else "Hello"
    if not isinstance(question, str):  # a turn with images (launcher/data/images.py): its text, each image a stand-in
        from launcher.data.images import text_of

        question = text_of(question)
    q = shlex.quote
    switches = template_switches(report)
    parts = [
        f"# Serving {name}",
        "",
        f"Written by `ftrun export` for the run in `{run.root}` ({recipe.method} of `{recipe.model}`).",
        f"Every output below was reloaded and compared with its reference on the prompts export.json names "
        f"({report.get('parity_prompts_from') or 'the data'}); the numbers are there.",
        "",
    ]
    if switches:
        think = switches.get("enable_thinking")
        parts += [
            f"**Serve with the chat-template switch `{json.dumps(switches)}`.** The model's chat template "
            "writes what training put in front of every answer only with it"
            + (" (an empty think block: the answers trained have no reasoning)" if think is False else "")
            + "; without it the served prompt differs from the trained one (export.json served_prompt). "
            "The commands below pass it: vLLM `--default-chat-template-kwargs`, llama-server "
            "`--chat-template-kwargs`"
            + (', Ollama `--think=false` (API: `"think": false`)' if think is False else "")
            + "; a request's own `chat_template_kwargs` overrides the server's.",
            "",
        ]
    rows = []
    for key in ("adapter", "model", "merged", "gguf"):
        if key in outputs:
            o = outputs[key]
            par = o.get("parity_vs_merged") or o.get("parity_vs_base_plus_adapter") or o.get("parity_vs_full_model")
            check = (
                f"top-1 agreement {par['top1_agreement']:.4f}, greedy identical {par['greedy_identical']}"
                if par
                else "reloads; changes the base model's output"
                if key == "adapter"
                else "as the trainer saved it"
            )
            rows.append(f"| {key} | `{o['path']}` | {o['size']} | {check} |")
    parts += ["| output | path | size | check |", "|---|---|---|---|", *rows, ""]

    if "adapter" in outputs:
        rank = outputs["adapter"]["rank"]
        parts += [
            "## vLLM: the base model with the adapter",
            "",
            "The adapter is small; vLLM loads the base model once and applies the adapter per request "
            "(the model name `" + name + "` selects it, the base id the plain model).",
            "",
            *fence(
                vllm_command(
                    recipe.model,
                    lora_module=name + "=" + outputs["adapter"]["path"],
                    lora_rank=rank,
                    max_model_len=recipe.max_length,
                    breaks=True,
                    switches=switches,
                )
            ),
        ]
        if is_quantized(recipe.method):
            parts += [
                "The adapter was trained against the 4-bit base; served on the 16-bit base it behaves like "
                "the merged model below (the standard QLoRA deployment).",
                "",
            ]
        parts += fence(_curl(name, question))
    if "merged" in outputs or "model" in outputs:
        mpath = outputs["merged" if "merged" in outputs else "model"]["path"]
        parts += [
            "## vLLM: the " + ("merged 16-bit" if "merged" in outputs else "fully fine-tuned") + " model",
            "",
            "No adapter at run time; add `--tensor-parallel-size N` for a model larger than one GPU.",
            "",
            *fence(vllm_command(mpath, name=name, max_model_len=recipe.max_length, breaks=True, switches=switches)),
            *fence(_curl(name, question)),
        ]
    mf = None
    if "gguf" in outputs:
        g = outputs["gguf"]
        gname = Path(g["path"]).name
        mf = modelfile(
            gname, tokenizer, prompts or convs, recipe.max_length, eos_ids=eos_ids, architecture=g.get("architecture")
        )
        gdir = Path(g["path"]).parent
        feats = mf["check"]
        par = g.get("parity_vs_merged") or {}
        parts += [
            "## Ollama: the GGUF",
            "",
            f"`{gdir / 'Modelfile'}` points at `{gname}` ({g['type']}, {g['size']}, made by llama.cpp's converter "
            "and quantizer and read back in llama.cpp: "
            + (
                f"top-1 agreement {par['top1_agreement']:.4f} and "
                f"perplexity {par['perplexity_rel_diff']:+.2%} against the merged model"
                if par.get("perplexity_rel_diff") is not None
                else "see export.json"
            )
            + ") and "
            + (
                "carries the chat template as an Ollama template, checked to render the parity prompts exactly as "
                "the model's own template"
                if 'TEMPLATE """' in mf["text"]
                else "has no TEMPLATE line (" + feats["ollama"]["why"] + ")"
            )
            + (f", with the stop tokens {', '.join(f'`{x}`' for x in feats['stop'])}" if feats["stop"] else "")
            + ".",
            "",
            *_go_template_off(feats["ollama"]),
            *fence(
                f"cd {q(str(gdir))}",
                f"ollama create {q(name)} -f Modelfile",
                f"ollama run {q(name)}"
                + (" --think=false" if switches.get("enable_thinking") is False else "")
                + f" {q(question)}",
            ),
        ]
        if feats.get("tools") or feats.get("thinking"):
            parts += [
                "The template has "
                + " and ".join(k for k in ("tools", "thinking") if feats.get(k))
                + ": Ollama 0.30.0 or newer renders the GGUF's own template with them when no Go template of "
                "its own is closer to it than its rule allows (export.json says which it chose); "
                "`ollama show "
                + name
                + " --template` shows the Go template Ollama stored, if any"
                + (
                    "; `ollama run " + name + " --think=false` answers without the thinking part"
                    if feats.get("thinking")
                    else ""
                )
                + ".",
                "",
            ]
        parts += [
            "Ollama's OpenAI-compatible API:",
            "",
            *fence(_curl(name, question, port=11434)),
            *fence(mf["text"].rstrip()),
            "llama.cpp directly: `llama-server -m "
            + q(str(g["path"]))
            + f" -c {recipe.max_length} --jinja"
            + (f" --chat-template-kwargs {q(json.dumps(switches))}" if switches else "")
            + "`",
            "",
        ]
    if "merged" in outputs:
        mdir = outputs["merged"]["path"]
        parts += [
            "## Ollama: from the merged folder",
            "",
            "Ollama can also convert and quantize the merged safetensors itself (its own converter, which "
            "ftrun's checks do not cover; it knows fewer architectures than llama.cpp's):",
            "",
            *fence(
                f"printf 'FROM %s\\n' {q(str(mdir))} > Modelfile.merged",
                f"ollama create {q(name + '-ollama')} -q q4_K_M -f Modelfile.merged",
                f"ollama run {q(name + '-ollama')} {q(question)}",
            ),
        ]
    return "\n".join(parts), mf
