"""The served prompt is the trained prompt: each runtime's rendering of the held-out prompts, token for token
against the training's, and the token that ends a turn against each runtime's stops.

The reference is the worker's own tokenization: the base model's tokenizer as the worker loads it
(launcher/worker/loading.py load_tokenizer), the conversation before its last answer rendered by TRL's call,
`apply_chat_template(prompt, tools=..., add_generation_prompt=True, tokenize=True)` (trl 1.16
trainer/sft_trainer.py tokenize_fn, data_utils.py _tokenize; with `assistant_only_loss` and a template without
`{% generation %}` markers, the training template TRL swaps in). Each runtime is then asked for the same prompt:
- transformers and vLLM: the exported folder's tokenizer and chat template (tokenizer_config.json /
  chat_template.jinja), `apply_chat_template(..., tokenize=False, add_generation_prompt=True)` tokenized without
  special tokens. vLLM's chat endpoint does exactly this: it resolves the template with
  `tokenizer.get_chat_template` (vllm/entrypoints/chat_utils.py resolve_hf_chat_template), renders it through
  transformers' apply_chat_template (apply_hf_chat_template) and tokenizes with add_special_tokens=False (the
  chat request's default); with `--lora-modules` it takes the adapter folder's tokenizer when the folder has one
  (vllm/transformers_utils/tokenizer.py get_lora_tokenizer), else the base model's.
- llama.cpp: the GGUF's embedded template through llama-cpp-python's Jinja chat formatter with the GGUF's own
  BOS/EOS texts, tokenized by the GGUF's vocabulary (llamacpp.py chat_prompt), as its chat completion does.
- Ollama: the Modelfile's TEMPLATE rendered as Ollama renders a Go template (go_template.py), tokenized by the
  GGUF's vocabulary with its special tokens added, as Ollama's runner does.
A prompt that differs fails the export, with the first differing token and the tokens before it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from launcher.deliver.messages import ExportError

CONTEXT_TOKENS = 8  # tokens shown before the first difference


# ---------------------------------------------------------------------------------------------
# What the training saw

def training_tokenizer(recipe, saved: Path):
    """(the worker's tokenizer, where it came from): the base model's, as the worker loads it; the run's saved
    copy when the base is not on this box (a Hub id not in the cache)."""
    from launcher.worker.loading import load_tokenizer

    try:
        return load_tokenizer(recipe), f"the base model's tokenizer ({recipe.model}), as the worker loads it"
    except (OSError, ValueError):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(saved)), f"the run's saved tokenizer ({saved}; {recipe.model} is not here)"


def _training_template(recipe, tokenizer) -> tuple[Optional[str], Optional[str]]:
    """The template TRL trained with when it is not the tokenizer's own (assistant_only_loss on a template
    without generation markers: trl/trainer/sft_trainer.py swaps in get_training_chat_template), and why."""
    if not getattr(recipe, "assistant_only_loss", False):
        return None, None
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return None, None
    return get_training_chat_template(tokenizer), "TRL's training template (assistant_only_loss)"


def _end_of_turn(tokenizer, text: str, answer: str) -> Optional[int]:
    """The index of the first token after the answer in the training sequence (the token the training taught to
    end a turn), None when nothing follows the answer, -1 when the template does not write the answer verbatim."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for candidate in (answer, answer.strip()):
        at = text.rfind(candidate) if candidate else -1
        if at >= 0:
            end = at + len(candidate)
            return next((k for k, (s, e) in enumerate(enc["offset_mapping"]) if e > end and e > s), None)
    return -1


class ServedPrompt:
    """The trained prompts of the held-out conversations and every runtime's comparison with them; `report` is
    what goes into export.json (served_prompt)."""

    def __init__(self, recipe, saved_tokenizer: Path, n: int):
        from launcher.data import formats as data_formats
        from launcher.deliver.parity import held_out_examples

        raw, source = held_out_examples(recipe)
        raw = raw[:n]
        self.tokenizer, tok_from = training_tokenizer(recipe, saved_tokenizer)
        self.chat = bool(raw) and all(data_formats.conversational(e) for e in raw)
        self.report: dict[str, Any] = {"prompts_from": source, "prompts": len(raw), "tokenizer": tok_from,
                                       "checked": [], "runtimes": {}, "stops": {}, "ending": {}, "ok": True}
        self.prompts: list[dict[str, Any]] = []
        self.end_ids: set[int] = set()
        if not self.chat:
            form = data_formats.example_form(raw[0]) if raw else "none"
            self.report["not_applicable"] = (f"the data is {form.replace('_', '/')} without a chat template: training "
                                             "rendered no chat prompt, so a chat endpoint's prompt has nothing to "
                                             "match; serve it through /v1/completions with the raw prompt")
            return
        template, why = _training_template(recipe, self.tokenizer)
        if why:
            self.report["training_template"] = why
        ends, untrained, rewritten = [], 0, 0
        for ex in raw:
            conv = data_formats.conversation(ex)
            tools = ex.get("tools")
            tools = json.loads(tools) if isinstance(tools, str) else tools
            last = max((i for i, m in enumerate(conv) if m["role"] == "assistant"), default=len(conv))
            prompt = conv[:last] or conv[:1]
            kw = {"tools": tools, "chat_template": template}
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, **kw)["input_ids"]
            self.prompts.append({"messages": prompt, "tools": tools, "ids": list(ids)})
            if last >= len(conv):
                continue
            full = conv[:last + 1]
            text = self.tokenizer.apply_chat_template(full, tokenize=False, **kw)
            k = _end_of_turn(self.tokenizer, text, conv[last]["content"] or "")
            if k == -1:
                rewritten += 1
                continue
            if k is None:
                ends.append(None)
                continue
            seq = self.tokenizer.apply_chat_template(full, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=bool(getattr(
                                                         recipe, "assistant_only_loss", False)), **kw)
            ends.append(seq["input_ids"][k])
            if "assistant_masks" in seq and not seq["assistant_masks"][k]:
                untrained += 1
        self.end_ids = {e for e in ends if e is not None}
        self.report["end_of_turn"] = {
            "ids": sorted(self.end_ids), "tokens": [self.token(i) for i in sorted(self.end_ids)],
            "answers_followed_by_nothing": sum(e is None for e in ends),
            "outside_the_loss": untrained, "answers_not_written_verbatim": rewritten,
        }

    # -----------------------------------------------------------------------------------------
    def token(self, i: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(int(i)) or f"<{i}>"

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def difference(self, trained: list[int], served: list[int]) -> Optional[dict[str, Any]]:
        """The first position where the served ids leave the trained ones, with the tokens before it."""
        if trained == served:
            return None
        i = next((k for k, (a, b) in enumerate(zip(trained, served)) if a != b), min(len(trained), len(served)))
        side = lambda ids: {"id": ids[i], "token": self.token(ids[i])} if i < len(ids) else None  # noqa: E731
        return {"position": i, "trained_length": len(trained), "served_length": len(served),
                "trained": side(trained), "served": side(served),
                "context": self._text(trained[max(0, i - CONTEXT_TOKENS):i])}

    def compare(self, key: str, runtime: str, served: list[list[int]], **extra: Any) -> dict[str, Any]:
        """Record one runtime's token ids for every held-out prompt; a difference fails the export."""
        diffs = [self.difference(p["ids"], s) for p, s in zip(self.prompts, served)]
        same = sum(d is None for d in diffs)
        first = next(((n, d) for n, d in enumerate(diffs) if d is not None), None)
        entry = {"runtime": runtime, "identical": f"{same}/{len(diffs)}", "ok": first is None,
                 "first_difference": dict(first[1], prompt=first[0]) if first else None, **extra}
        self.report["runtimes"][key] = entry
        if first is not None:
            self.report["ok"] = False
            d = first[1]
            got = (f"{d['served']['id']} {d['served']['token']!r}" if d["served"] else "the end of the prompt")
            want = (f"{d['trained']['id']} {d['trained']['token']!r}" if d["trained"] else "the end of the prompt")
            raise ExportError(
                f"{runtime} serves another prompt than the training saw (held-out prompt {first[0] + 1} of "
                f"{len(diffs)}): at token {d['position']} it has {got} where training had {want}, after "
                f"{d['context']!r}; identical {entry['identical']}",
                fix="do not serve this output as it is: the model would answer a prompt it was never trained on. "
                "The template or tokenizer that runtime reads is not the one training used (see "
                "final/export.json served_prompt); re-export from the run, and report it if it repeats.")
        return entry

    def checked(self, name: str) -> None:
        if name not in self.report["checked"]:
            self.report["checked"].append(name)

    # -----------------------------------------------------------------------------------------
    def compare_transformers(self, key: str, tokenizer, runtime: str) -> dict[str, Any]:
        served = []
        for p in self.prompts:
            text = tokenizer.apply_chat_template(p["messages"], tools=p["tools"], tokenize=False,
                                                 add_generation_prompt=True)
            served.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        entry = self.compare(key, runtime, served)
        self.checked("vLLM")
        return entry

    def check_stops(self, key: str, runtime: str, covered: list[int], fix: str, **extra: Any) -> dict[str, Any]:
        """The end-of-turn token(s) the training taught are among a runtime's stops, else the export fails."""
        missing = sorted(self.end_ids - set(covered))
        entry = {"runtime": runtime, "ok": not missing and bool(self.end_ids), **extra}
        self.report["stops"][key] = entry
        if not self.end_ids:
            self.report["ok"] = False
            raise ExportError("the training taught no token to end a turn: in the training sequence nothing follows "
                              "the assistant's answer, so a served model does not know when to stop",
                              fix="use a chat template that closes the assistant turn with an end-of-turn token "
                              "(Qwen's <|im_end|>, Llama 3's <|eot_id|>), then train again.")
        if missing:
            self.report["ok"] = False
            names = ", ".join(f"{i} {self.token(i)!r}" for i in missing)
            raise ExportError(f"{runtime} does not stop on the token the training taught to end a turn ({names})", fix=fix)
        return entry

    @staticmethod
    def covered_by_stops(pieces: dict[int, str], stops: list[str]) -> list[int]:
        """The end-of-turn ids whose text holds a stop value: Ollama stops when the generated text contains one
        (runner/ollamarunner/runner.go, common.FindStop), so such a token ends the answer."""
        return [i for i, piece in pieces.items() if any(s and s in piece for s in stops)]

    def ending(self, key: str, outs: list[dict[str, Any]], stop_ids: set[int]) -> dict[str, Any]:
        """Share of held-out prompts whose greedy continuation ends its turn with the trained end-of-turn token
        (the first end token it reaches is that one) within its budget; a measure, not a bound: a tiny or
        briefly trained model may not have learned to stop."""
        ended = other = 0
        for o in outs:
            cont = o.get("continuation") or []
            first = next((t for t in cont if t in self.end_ids or t in stop_ids), None)
            ended += int(first is not None and first in self.end_ids)
            other += int(first is not None and first not in self.end_ids)
        entry = {"ended_with_end_of_turn": f"{ended}/{len(outs)}", "share": round(ended / max(len(outs), 1), 4),
                 "ended_with_another_stop": other, "tokens_run": [len(o.get("continuation") or []) for o in outs]}
        self.report["ending"][key] = entry
        return entry


# ---------------------------------------------------------------------------------------------
# The Modelfile, as Ollama reads it

def modelfile_parts(text: str) -> tuple[Optional[str], list[str]]:
    """(TEMPLATE, PARAMETER stop values) of a Modelfile as serving.py writes it (a triple-quoted TEMPLATE, stop
    values as JSON strings)."""
    template = None
    if 'TEMPLATE """' in text:
        template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    stops = []
    for line in text.splitlines():
        if line.startswith("PARAMETER stop "):
            value = line[len("PARAMETER stop "):].strip()
            stops.append(json.loads(value) if value.startswith('"') else value)
    return template, stops
