"""The served prompt is the trained prompt: each runtime's rendering of the conversations' prompts, token for token
against what the training put in front of the answer, and the token that ends a turn against each runtime's stops.

The reference is the training sequence itself (trl 1.16 trainer/sft_trainer.py tokenize_fn renders a conversation
whole, with no generation prompt): the tokens in front of the last answer. Where the template has switches (Qwen3's
`enable_thinking`), the setting that serves the trained context is found once (`kwargs`). Each runtime renders the
same prompts (vllm/entrypoints/chat_utils.py resolve_hf_chat_template, vllm/transformers_utils/tokenizer.py
get_lora_tokenizer; llamacpp_runtime.py; ollama_template.py): one that differs fails the export. docs/evaluation.md,
"After the export: the served prompt is the trained prompt", has the cases and the runtimes' source lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from launcher.data.chat_prompt import generation_ids, shape, switches, trained_context
from launcher.deliver.messages import ExportError, _say

CONTEXT_TOKENS = 8  # tokens shown before the first difference
MAX_SHAPES = 24  # conversation shapes (sequences of roles) checked, the most frequent first


def training_tokenizer(recipe, saved: Path):
    """(the worker's tokenizer, where it came from); the run's saved copy where the base is not on this box."""
    from launcher.worker.loading import load_tokenizer
    from launcher.worker.processor import text_tokenizer

    try:
        # a vision-language model's processor: its tokenizer renders the prompts, one placeholder token per image
        tokenizer = text_tokenizer(load_tokenizer(recipe, say=_say))
        return tokenizer, f"the base model's tokenizer ({recipe.model}), as the worker loads it"
    except (OSError, ValueError):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(saved)
        ), f"the run's saved tokenizer ({saved}; {recipe.model} is not here)"


def _training_template(recipe, tokenizer) -> tuple[Optional[str], Optional[str]]:
    """TRL's training template and why, where assistant_only_loss swapped one in (sft_trainer.py), else Nones."""
    if not getattr(recipe, "assistant_only_loss", False):
        return None, None
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return None, None
    return get_training_chat_template(tokenizer), "TRL's training template (assistant_only_loss)"


def _end_of_turn(tokenizer, text: str, answer: str) -> Optional[int]:
    """Index of the first token after the answer; None when nothing follows, -1 when the answer is not verbatim."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for candidate in (answer, answer.strip()):
        at = text.rfind(candidate) if candidate else -1
        if at >= 0:
            end = at + len(candidate)
            return next((k for k, (s, e) in enumerate(enc["offset_mapping"]) if e > end and e > s), None)
    return -1


class ServedPrompt:
    """The trained prompts and every runtime's comparison with them; `report` goes into export.json."""

    def __init__(self, recipe, saved_tokenizer: Path, n: int):
        from launcher.data import formats as data_formats
        from launcher.deliver.parity import examples_of

        unread = None
        try:
            raw, source, data = examples_of(recipe, with_data=True)
        except Exception as exc:  # noqa: BLE001 - eval.data here, the training data not (an export on another box)
            (raw, source, _), data = examples_of(recipe), []
            unread = f"the training data could not be read here ({type(exc).__name__}): shapes of eval.data only"
        self.tokenizer, tok_from = training_tokenizer(recipe, saved_tokenizer)
        self.chat = bool(raw) and all(data_formats.conversational(e) for e in raw)
        self.report: dict[str, Any] = {
            "prompts_from": source,
            "prompts": min(n, len(raw)),
            "tokenizer": tok_from,
            "checked": [],
            "runtimes": {},
            "stops": {},
            "ending": {},
            "ok": True,
        }
        self.prompts: list[dict[str, Any]] = []
        self.end_ids: set[int] = set()
        self.kwargs: dict[str, Any] = {}  # the chat-template switches every runtime serves with
        if not self.chat:
            form = data_formats.example_form(raw[0]) if raw else "none"
            self.report["not_applicable"] = (
                f"the data is {form.replace('_', '/')} without a chat template: training "
                "rendered no chat prompt, so a chat endpoint's prompt has nothing to "
                "match; serve it through /v1/completions with the raw prompt"
            )
            return
        template, why = _training_template(recipe, self.tokenizer)
        if why:
            self.report["training_template"] = why
        chosen = self._choose(raw, data or [], n)
        if unread:
            self.report["shapes"]["note"] = unread  # said in export.json, not a quiet narrowing
        ends, untrained, rewritten, merged = [], 0, 0, 0
        for ex, kind in chosen:
            conv = data_formats.conversation(ex)
            tools = ex.get("tools")
            tools = json.loads(tools) if isinstance(tools, str) else tools
            last = max((i for i, m in enumerate(conv) if m["role"] == "assistant"), default=len(conv))
            prompt = conv[:last] or conv[:1]
            kw = {"tools": tools, "chat_template": template}
            entry = {"messages": prompt, "tools": tools, "shape": shape(conv), "from": kind}
            ctx = trained_context(self.tokenizer, conv, last, kw) if last < len(conv) else None
            if ctx is None:
                # no answer to find in the sequence (a tool call, a rewritten answer): the generation prompt stands in
                rewritten += last < len(conv)
                entry["ids"] = list(
                    self.tokenizer.apply_chat_template(
                        prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **kw
                    )["input_ids"]
                )
                entry["reference"] = "the generation prompt (the answer is not in the training sequence verbatim)"
            else:
                entry.update(ids=ctx["ids"], answer_first=ctx["next"], answer_first_merged=ctx["merged"])
                entry["reference"] = "the tokens in front of the answer in the training sequence"
                merged += ctx["merged"]
            self.prompts.append(entry)
            if last >= len(conv) or kind != "held out":
                continue
            full = conv[: last + 1]
            text = self.tokenizer.apply_chat_template(full, tokenize=False, **kw)
            k = _end_of_turn(self.tokenizer, text, conv[last]["content"] or "")
            if k == -1:
                continue
            if k is None:
                ends.append(None)
                continue
            seq = self.tokenizer.apply_chat_template(
                full,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=bool(getattr(recipe, "assistant_only_loss", False)),
                **kw,
            )
            ends.append(seq["input_ids"][k])
            if "assistant_masks" in seq and not seq["assistant_masks"][k]:
                untrained += 1
        self.end_ids = {e for e in ends if e is not None}
        self.report["end_of_turn"] = {
            "ids": sorted(self.end_ids),
            "tokens": [self.token(i) for i in sorted(self.end_ids)],
            "answers_followed_by_nothing": sum(e is None for e in ends),
            "outside_the_loss": untrained,
            "answers_not_written_verbatim": rewritten,
        }
        self.report["reference"] = (
            "the tokens in front of the last answer in the training sequence (TRL renders a "
            "conversation whole, with no generation prompt)"
        )
        self.report["answers_whose_first_token_holds_the_prompts_end"] = merged
        self.kwargs = self._switches()
        if self.kwargs:
            self.report["chat_template_kwargs"] = self.kwargs

    def _choose(
        self, held: list[dict[str, Any]], trained: list[dict[str, Any]], n: int
    ) -> list[tuple[dict[str, Any], str]]:
        """The first n held-out conversations, then one of every other shape, most frequent first."""
        from collections import Counter

        from launcher.data import formats as data_formats

        chosen = [(ex, "held out") for ex in held[:n]]
        seen_ids = {id(e) for e in trained}  # the held-out examples are among the data's unless eval.data holds them
        pool = [e for e in list(trained) + [h for h in held if id(h) not in seen_ids] if data_formats.conversational(e)]
        shapes = Counter(shape(data_formats.conversation(e)) for e in pool)
        seen = {shape(data_formats.conversation(e)) for e, _ in chosen}
        first: dict[str, dict[str, Any]] = {}
        for e in pool:
            first.setdefault(shape(data_formats.conversation(e)), e)
        for sh, _ in shapes.most_common():
            if len(seen) >= MAX_SHAPES:
                break
            if sh not in seen:
                seen.add(sh)
                chosen.append((first[sh], "shape"))
        self.report["shapes"] = {
            "found": len(shapes),
            "checked": len(seen),
            "each": {sh: c for sh, c in shapes.most_common()},
        }
        return chosen

    def _switches(self) -> dict[str, Any]:  # the chat-template switches every runtime serves with
        return switches(self.tokenizer, [(p["messages"], p["tools"], p["ids"]) for p in self.prompts])

    @staticmethod
    def render_ids(tokenizer, p: dict[str, Any], kw: dict[str, Any]) -> list[int]:
        return generation_ids(tokenizer, p["messages"], p["tools"], kw)

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
        return {
            "position": i,
            "trained_length": len(trained),
            "served_length": len(served),
            "trained": side(trained),
            "served": side(served),
            "context": self._text(trained[max(0, i - CONTEXT_TOKENS) : i]),
        }

    def _wanted(self, d: dict[str, Any], prompt: dict[str, Any]) -> str:
        """What training had at the first difference, in words."""
        if d["trained"]:
            return f"{d['trained']['id']} {d['trained']['token']!r}"
        nxt = prompt.get("answer_first")
        if nxt is None:
            return "the end of the prompt"
        held = " (it begins with the end of the served prompt)" if prompt.get("answer_first_merged") else ""
        return f"the answer, whose first token was {nxt} {self.token(nxt)!r}{held}"

    def compare(
        self, key: str, runtime: str, served: list[list[int]], fix: Optional[str] = None, **extra: Any
    ) -> dict[str, Any]:
        """Record one runtime's token ids for every prompt; a difference fails the export (`fix`: what to do)."""
        diffs = [self.difference(p["ids"], s) for p, s in zip(self.prompts, served)]
        same = sum(d is None for d in diffs)
        first = next(((n, d) for n, d in enumerate(diffs) if d is not None), None)
        entry = {
            "runtime": runtime,
            "identical": f"{same}/{len(diffs)}",
            "ok": first is None,
            "first_difference": dict(first[1], prompt=first[0]) if first else None,
            **extra,
        }
        self.report["runtimes"][key] = entry
        if first is not None:
            self.report["ok"] = False
            d = first[1]
            got = f"{d['served']['id']} {d['served']['token']!r}" if d["served"] else "the end of the prompt"
            p = self.prompts[first[0]]
            raise ExportError(
                f"{runtime} serves another prompt than the training saw (prompt {first[0] + 1} of {len(diffs)}, "
                f"{p['from']}, roles {p['shape']}): at token {d['position']} it has {got} where training had "
                f"{self._wanted(d, p)}, after {d['context']!r}; identical {entry['identical']}"
                + (f" (served with {json.dumps(self.kwargs)})" if self.kwargs else ""),
                fix=fix or self._fix(),
            )
        return entry

    def _fix(self) -> str:
        """What to do when a runtime's prompt differs: the training has to change."""
        head = "do not serve this output as it is: the model would answer a prompt it was never trained on. "
        if self.report.get("training_template"):
            return head + (
                "It trained with TRL's training template (assistant_only_loss), which writes the turns before an "
                "answer otherwise than the model's own template that every runtime serves: train again with the "
                "served template (assistant_only_loss: false, or the conversations as prompt/completion records, "
                "whose completion TRL trains alone with the model's own template)."
            )
        return head + (
            "The model's chat template renders its generation prompt otherwise than what it writes before an answer "
            "(see final/export.json served_prompt): change the template (chat_template.jinja in the model folder) "
            "so they agree, or train a model whose template does, then train again."
        )

    def checked(self, name: str) -> None:
        if name not in self.report["checked"]:
            self.report["checked"].append(name)

    def compare_transformers(self, key: str, tokenizer, runtime: str) -> dict[str, Any]:
        served = [self.render_ids(tokenizer, p, self.kwargs) for p in self.prompts]
        entry = self.compare(key, runtime, served, chat_template_kwargs=self.kwargs or None)
        self.checked("vLLM")
        return entry

    def check_stops(self, key: str, runtime: str, covered: list[int], fix: str, **extra: Any) -> dict[str, Any]:
        """The end-of-turn token(s) the training taught are among a runtime's stops, else the export fails."""
        missing = sorted(self.end_ids - set(covered))
        entry = {"runtime": runtime, "ok": not missing and bool(self.end_ids), **extra}
        self.report["stops"][key] = entry
        if not self.end_ids:
            self.report["ok"] = False
            raise ExportError(
                "the training taught no token to end a turn: in the training sequence nothing follows "
                "the assistant's answer, so a served model does not know when to stop",
                fix="use a chat template that closes the assistant turn with an end-of-turn token "
                "(Qwen's <|im_end|>, Llama 3's <|eot_id|>), then train again.",
            )
        if missing:
            self.report["ok"] = False
            names = ", ".join(f"{i} {self.token(i)!r}" for i in missing)
            raise ExportError(
                f"{runtime} does not stop on the token the training taught to end a turn ({names})", fix=fix
            )
        return entry

    @staticmethod
    def covered_by_stops(pieces: dict[int, str], stops: list[str]) -> list[int]:
        """End-of-turn ids whose text holds a stop value (Ollama runner.go common.FindStop)."""
        return [i for i, piece in pieces.items() if any(s and s in piece for s in stops)]

    def ending(self, key: str, outs: list[dict[str, Any]], stop_ids: set[int]) -> dict[str, Any]:
        """Share of held-out prompts whose greedy continuation ends with the trained end of turn."""
        ended = other = 0
        for o in outs:
            cont = o.get("continuation") or []
            first = next((t for t in cont if t in self.end_ids or t in stop_ids), None)
            ended += int(first is not None and first in self.end_ids)
            other += int(first is not None and first not in self.end_ids)
        entry = {
            "ended_with_end_of_turn": f"{ended}/{len(outs)}",
            "share": round(ended / max(len(outs), 1), 4),
            "ended_with_another_stop": other,
            "tokens_run": [len(o.get("continuation") or []) for o in outs],
        }
        self.report["ending"][key] = entry
        return entry


def modelfile_parts(text: str) -> tuple[Optional[str], list[str]]:
    """(TEMPLATE, PARAMETER stop values) of a Modelfile as serving.py writes it."""
    template = None
    if 'TEMPLATE """' in text:
        template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    stops = []
    for line in text.splitlines():
        if line.startswith("PARAMETER stop "):
            value = line[len("PARAMETER stop ") :].strip()
            stops.append(json.loads(value) if value.startswith('"') else value)
    return template, stops
