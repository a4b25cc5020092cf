"""A GGUF read back in llama.cpp's runtime (llama-cpp-python): its metadata, logits, prompts and answers. Only the
standard library at module level.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Optional


def metadata(path: Path) -> dict[str, Any]:
    """The GGUF's architecture numbers, tokenizer, chat template and tensor types (the gguf package's reader)."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def f(key: str):
        x = r.fields.get(key)
        return None if x is None else x.contents()

    arch = f("general.architecture")
    counts = Counter(t.tensor_type.name for t in r.tensors)
    tokens = r.fields.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "file_type": f("general.file_type"),
        "block_count": f(f"{arch}.block_count"),
        "embedding_length": f(f"{arch}.embedding_length"),
        "feed_forward_length": f(f"{arch}.feed_forward_length"),
        "head_count": f(f"{arch}.attention.head_count"),
        "head_count_kv": f(f"{arch}.attention.head_count_kv"),
        "key_length": f(f"{arch}.attention.key_length"),
        "rms_eps": f(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_freq_base": f(f"{arch}.rope.freq_base"),
        "vocab_size": len(tokens.data) if tokens is not None else None,
        "chat_template": f("tokenizer.chat_template"),
        "tokenizer_pre": f("tokenizer.ggml.pre"),
        "tokenizer_model": f("tokenizer.ggml.model"),
        "eos_token_id": f("tokenizer.ggml.eos_token_id"),
        "tensors": len(r.tensors),
        "tensor_types": dict(sorted(counts.items())),
        "tensor_names": [t.name for t in r.tensors],
    }


def _open(path: Path, n_ctx: int, threads: Optional[int] = None, overrides: Optional[dict[str, Any]] = None):
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        n_threads=threads or os.cpu_count(),
        n_gpu_layers=0,
        verbose=False,
        seed=0,
        kv_overrides=overrides or None,
    )


def run_gguf(
    path: Path,
    prompts: list[dict[str, Any]],
    greedy_tokens: int,
    stop_ids: set[int],
    threads: Optional[int] = None,
    to_end: bool = False,
    chat: Optional[list[dict[str, Any]]] = None,
    smoke: Optional[int] = None,
    template_kwargs: Optional[dict[str, Any]] = None,
    overrides: Optional[dict[str, Any]] = None,
    task: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Per prompt, with one model load: the teacher-forced logits at every position, the greedy continuation (stopping
    after an end token, as generate does; with to_end on to the prompt's `budget` in `continuation`), and whether
    llama.cpp tokenizes the text as the model's tokenizer did. `chat`: conversations rendered by the GGUF's template
    as llama-cpp-python (chat_prompt) and llama-server (server_prompt, with `template_kwargs`) do; `smoke`: the
    index of the one answered through chat completion (chat_smoke); `overrides`: --override-kv metadata (tests);
    `task` (RUN/task.json): its prompts answered as llama-server serves them (task_answers)."""
    import numpy as np
    import torch

    budgets = [max(greedy_tokens, p.get("budget", 0)) if to_end else greedy_tokens for p in prompts]
    n_ctx = max(max(len(p["ids"]), len(p["prompt_ids"]) + b) for p, b in zip(prompts, budgets)) + 8
    if chat:
        n_ctx = max(n_ctx, max(len(c["ids"]) for c in chat) + greedy_tokens + 8)
    if task:
        # every non-special token covers at least a byte: the prompt's bytes plus the template's bound its length
        n_ctx = max(
            n_ctx,
            max(
                len(json.dumps(p.get("messages") or p.get("text"), ensure_ascii=False).encode())
                for p in task["prompts"]
            )
            + 256
            + task["max_new_tokens"],
        )
    llm = _open(path, n_ctx, threads, overrides)
    outs, same_tokens = [], []
    result: dict[str, Any] = {}
    try:
        for p, budget in zip(prompts, budgets):
            ids = list(p["ids"])
            same_tokens.append(llm.tokenize(p["text"].encode(), add_bos=False, special=True)[: len(ids)] == ids)
            llm.reset()
            llm.eval(ids)
            logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
            llm.reset()
            llm.eval(list(p["prompt_ids"]))
            tokens = _greedy(llm, budget, stop_ids)
            outs.append({"logits": logits, "greedy": tokens[:greedy_tokens], "continuation": tokens, "ids": ids})
        if chat:
            result["eog_ids"] = eog_ids(llm)
            result["bos_eos"] = {"bos": llm.token_bos(), "eos": llm.token_eos()}
            result["chat"] = [chat_prompt(llm, c["messages"], c.get("tools")) for c in chat]
            result["server"] = [server_prompt(llm, c["messages"], c.get("tools"), template_kwargs) for c in chat]
            result["adds"] = special_adds(llm)
            if smoke is not None:
                llm.reset()
                result["smoke"] = chat_smoke(llm, chat[smoke]["messages"], chat[smoke].get("tools"), greedy_tokens)
        if task:
            result["task_answers"] = task_answers(llm, task)
    finally:
        llm.close() if hasattr(llm, "close") else None
        del llm
    result.update(outputs=outs, same_tokens=same_tokens)
    return result


def _greedy(llm, budget: int, stops) -> list[int]:
    """Argmax tokens after what `llm` has evaluated, up to `budget`, stopping after one in `stops`."""
    import numpy as np

    tokens: list[int] = []
    for _ in range(budget):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if tokens[-1] in stops:
            break
        llm.eval(tokens[-1:])
    return tokens


def _end_texts(llm) -> tuple[int, str, str]:
    """(eos id, eos text, bos text) of the GGUF's vocabulary, "" for a token it lacks."""
    eos, bos = llm.token_eos(), llm.token_bos()
    text = llm._model.token_get_text
    return eos, text(eos) if eos != -1 else "", text(bos) if bos != -1 else ""


class Vocabulary:
    """The GGUF's tokenizer alone (no weights): text to ids as a runtime serving the file does, and an id's piece."""

    def __init__(self, path: Path):
        from llama_cpp import Llama
        from llama_cpp._utils import suppress_stdout_stderr

        # a vocabulary-only context has no training length: llama.cpp's warning about it is not the user's
        with suppress_stdout_stderr(disable=False):
            self.llm = Llama(model_path=str(path), vocab_only=True, n_ctx=8, verbose=False)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    def piece(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode("utf-8", "replace")

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None


def chat_prompt(llm, messages: list[dict[str, Any]], tools: Optional[list] = None) -> dict[str, Any]:
    """The prompt llama-cpp-python's chat completion builds from the GGUF (llama_chat_format.py
    chat_formatter_to_chat_completion_handler): its template through Jinja2ChatFormatter with the GGUF's BOS/EOS
    texts, tokenized with specials parsed, a BOS added unless the template added its own."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return {"text": None, "ids": None, "template": None}
    eos, eos_text, bos_text = _end_texts(llm)
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos_text, bos_token=bos_text, stop_token_ids=[eos])
    res = formatter(messages=messages, tools=tools)
    ids = llm.tokenize(res.prompt.encode("utf-8"), add_bos=not res.added_special, special=True)
    return {"text": res.prompt, "ids": list(ids), "template": template}


def task_answers(llm, task: dict[str, Any]) -> list[dict[str, Any]]:
    """Each task prompt answered greedily as llama-server serves it (a chat prompt as server_prompt renders it, text
    as /completion tokenizes it), up to an end-of-generation token: {"answer", "new_tokens", "seconds"} each."""
    import time

    eog = set(eog_ids(llm))
    out = []
    for p in task["prompts"]:
        t0 = time.monotonic()
        if "messages" in p:
            ids = server_prompt(llm, p["messages"], p.get("tools"), task.get("chat_template_kwargs"))["ids"]
        else:
            ids = list(llm.tokenize(p["text"].encode("utf-8"), add_bos=True, special=True))
        ids = ids[-(llm.n_ctx() - task["max_new_tokens"] - 1) :]  # as a server truncates: the prompt's end kept
        llm.reset()
        llm.eval(ids)
        tokens = _greedy(llm, task["max_new_tokens"], eog)
        text = llm.detokenize([t for t in tokens if t not in eog], special=False).decode("utf-8", "replace").strip()
        out.append({"answer": text, "new_tokens": len(tokens), "seconds": round(time.monotonic() - t0, 4)})
    return out


def special_adds(llm) -> dict[str, bool]:
    """Whether the GGUF's vocabulary adds BOS and EOS when tokenizing with specials (src/llama-vocab.cpp)."""
    import llama_cpp

    vocab = llm._model.vocab
    return {
        "bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
    }


def server_prompt(
    llm, messages: list[dict[str, Any]], tools: Optional[list] = None, template_kwargs: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """The prompt llama-server builds for /v1/chat/completions (llama.cpp@0c1e57098, vendored by llama-cpp-python
    0.3.36; Ollama 0.30+ uses it for a GGUF without a Go template, server/routes.go usesOllamaRenderedChat): the
    template rendered with the BOS/EOS texts (common/chat.cpp common_chat_templates_init), `enable_thinking` on
    (server-context.cpp 1444) and the kwargs (chat.cpp 905-966); a leading BOS / trailing EOS text cut where the
    vocabulary adds it (chat.cpp 958-964); tokenized with add_special and parse_special (server-context.cpp 4280).
    llama-cpp-python's Jinja2 stands in for llama.cpp's C++ Jinja."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return {"text": None, "ids": None, "template": None}
    _, eos_text, bos_text = _end_texts(llm)
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos_text, bos_token=bos_text)
    text = formatter(messages=messages, tools=tools, **{"enable_thinking": True, **(template_kwargs or {})}).prompt
    adds = special_adds(llm)
    if adds["bos"] and bos_text and text.startswith(bos_text):
        text = text[len(bos_text) :]
    if adds["eos"] and eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)]
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)  # llama_tokenize(add_special, parse_special)
    return {"text": text, "ids": list(ids), "template": template, "adds": adds}


def eog_ids(llm) -> list[int]:
    """Every token llama.cpp ends a generation on (EOS, EOT and end tokens by text: src/llama-vocab.cpp)."""
    import llama_cpp

    vocab = llm._model.vocab
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def chat_smoke(llm, messages: list[dict[str, Any]], tools: Optional[list], max_tokens: int) -> dict[str, Any]:
    """One greedy chat completion through `Llama.create_chat_completion`; the prompt and every token generated (end
    token included) are read off the runtime's token generator."""
    import time

    seen: dict[str, Any] = {"prompt": None, "tokens": []}
    generate = llm.generate

    def recording(tokens, *args, **kwargs):
        seen["prompt"] = list(tokens)
        for tok in generate(tokens, *args, **kwargs):
            seen["tokens"].append(int(tok))
            yield tok

    llm.generate = recording
    try:
        t0 = time.monotonic()
        greedy = dict(temperature=0.0, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=0)
        res = llm.create_chat_completion(messages=messages, tools=tools, max_tokens=max_tokens, **greedy)
        seconds = time.monotonic() - t0
    finally:
        del llm.generate
    choice = res["choices"][0]
    return {
        "seconds": round(seconds, 3),
        "prompt_ids": seen["prompt"],
        "tokens": seen["tokens"],
        "answer": choice["message"].get("content"),
        "finish_reason": choice.get("finish_reason"),
        "usage": res.get("usage"),
    }
