"""What a chat model learned to continue from: the tokens in front of an answer in the training sequence, and the
chat-template switches (Qwen3's `enable_thinking`) under which a template's generation prompt is those tokens.

TRL renders a conversation whole, with no generation prompt (trl 1.16 sft_trainer.py tokenize_fn), so a template
whose generation prompt differs from what precedes an assistant turn in its history (Qwen3's empty think block, a
trailing space the answer's first token swallows) asks another prompt than the one trained. The export's served-prompt
checks (deliver/served_prompt.py) and the task evaluation (worker/task_eval.py) ask with the switches found here.
"""

from __future__ import annotations

from typing import Any, Optional

# chat-template switches a template may read, and the values tried where its default does not give the trained context
TEMPLATE_SWITCHES = {"enable_thinking": (False, True)}


def shape(conv: list[dict[str, Any]]) -> str:
    """A conversation's roles up to the last assistant turn ("system,user,assistant(tool call),tool")."""
    last = max((i for i, m in enumerate(conv) if m["role"] == "assistant"), default=len(conv))
    return ",".join(
        m["role"] + ("(tool call)" if m["role"] == "assistant" and m.get("tool_calls") else "")
        for m in (conv[:last] or conv[:1])
    )


def trained_context(tokenizer, conv: list[dict[str, Any]], last: int, kw: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The training sequence's tokens before the last answer's first character ("ids"), the answer's first token
    ("next"; "merged": it begins inside the text before, as ` 16` after `ASSISTANT:`); None if not written verbatim."""
    full = conv[: last + 1]
    text = tokenizer.apply_chat_template(full, tokenize=False, **kw)
    ids = list(tokenizer.apply_chat_template(full, tokenize=True, return_dict=True, **kw)["input_ids"])
    answer = conv[last].get("content") or ""
    if not isinstance(answer, str) or not answer.strip():
        return None
    # the answer comes after the history: search from where the text stops being the history's own rendering
    history = tokenizer.apply_chat_template(conv[:last], tokenize=False, **kw) if last else ""
    lo = next((i for i, (x, y) in enumerate(zip(history, text)) if x != y), min(len(history), len(text)))
    at = next((i for i in (text.find(c, lo) for c in (answer, answer.strip())) if i >= 0), -1)
    if at < 0:
        return None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids:
        return None
    offsets = enc["offset_mapping"]
    k = next((j for j, (a, e) in enumerate(offsets) if e > at and e > a), len(ids))
    return {"ids": ids[:k], "next": ids[k] if k < len(ids) else None, "merged": k < len(ids) and offsets[k][0] < at}


def generation_ids(tokenizer, messages: list[dict[str, Any]], tools: Optional[list], kw: dict[str, Any]) -> list[int]:
    """A chat endpoint's prompt: rendered with the generation prompt, tokenized without special tokens (vLLM)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def switches(tokenizer, prompts: list[tuple[list[dict[str, Any]], Optional[list], list[int]]]) -> dict[str, Any]:
    """The chat-template switches under which the tokenizer's own template renders every (messages, tools, trained
    ids) prompt as trained: {} when its default does (or when none does), else the first setting that does."""
    own = tokenizer.chat_template or ""
    tried = [{}] + [{k: v} for k, values in TEMPLATE_SWITCHES.items() if k in own for v in values]
    for kw in tried:
        if all(generation_ids(tokenizer, messages, tools, kw) == ids for messages, tools, ids in prompts):
            return kw
    return {}


def task_switches(tokenizer, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The switches for the task evaluation's prompts, each with its reference as the answer ({} for plain-text
    prompts, a tokenizer without a chat template, or answers the template does not write verbatim)."""
    if not getattr(tokenizer, "chat_template", None):
        return {}
    found = []
    for p in prompts:
        if "messages" not in p:
            return {}
        conv = list(p["messages"]) + [{"role": "assistant", "content": p["reference"]}]
        ctx = trained_context(tokenizer, conv, len(conv) - 1, {"tools": p.get("tools")})
        if ctx is not None:
            found.append((p["messages"], p.get("tools"), ctx["ids"]))
    return switches(tokenizer, found) if found else {}
