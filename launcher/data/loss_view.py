"""What the loss sees: each example tokenized and masked as the trainer does it, and the checks that refuse data
which would train nothing, never teach the model to stop, or lose its answers to max_length, before any GPU time.

Follows trl 1.16.0 `SFTTrainer._prepare_dataset` (trl/trainer/sft_trainer.py) and its collator without torch;
tests/data/test_loss_view.py holds it token for token to TRL's own prepared dataset on each chat template family.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from launcher.data import formats
from launcher.errors import DataError

# Examples whose labels keep no token (TRL 1.16 drops them silently): above this share the data check refuses.
EMPTY_SHARE_LIMIT = 0.01
# The default of max_length_may_cut: the share of cut answers the data check allows (the test data's 256 cuts 3.8%)
CUT_SHARE_LIMIT = 0.05
# The example shown: at most this many characters, the middle elided.
SHOWN_CHARS = 900
PROBE_QUESTION, PROBE_ANSWER = "ftrun probe question", "ftrun probe answer"
OPEN, CLOSE = "[[", "]]"  # a trained span, as plain text (a pipe, data_example.txt)


@dataclass
class Settings:
    """The trainer fields that decide what the loss sees, from the recipe (defaults as trl 1.16 SFTConfig)."""

    max_length: Optional[int]
    assistant_only_loss: Optional[bool] = False  # None: left out, resolved by check() (resolve_answers_only)
    completion_only_loss: Optional[bool] = None  # None: prompt/completion data train the completion only
    packing: bool = False
    packing_strategy: str = "bfd"
    truncation_mode: str = "keep_start"
    eos_token: Optional[str] = None  # SFTConfig.eos_token: another EOS than the tokenizer's
    may_cut: float = CUT_SHARE_LIMIT  # the recipe's max_length_may_cut

    @classmethod
    def of(cls, recipe) -> "Settings":
        t = recipe.trainer
        return cls(
            max_length=recipe.max_length,
            assistant_only_loss=recipe.assistant_only_loss,
            completion_only_loss=t.get("completion_only_loss"),
            packing=recipe.packing,
            packing_strategy=t.get("packing_strategy", "bfd"),
            truncation_mode=t.get("truncation_mode", "keep_start"),
            eos_token=t.get("eos_token"),
            may_cut=getattr(recipe, "max_length_may_cut", CUT_SHARE_LIMIT),
        )


@dataclass
class Marked:
    """One example as the loss sees it: its tokens (after truncation), which are trained, and their text."""

    ids: list[int]
    trained: list[bool]
    pieces: list[str]
    length: int  # tokens before truncation
    cut: bool  # max_length removed trained tokens
    empty: bool  # no trained token left
    unmasked: bool  # the masks alone (before truncation) leave nothing: TRL stops on it with assistant_only_loss
    ends: list[int]  # per trained run that should end a turn: the index of its last non-blank token

    def segments(self) -> list[tuple[str, bool]]:
        """The text in runs of equal marking: [(text, trained), ...]."""
        out: list[tuple[str, bool]] = []
        for piece, t in zip(self.pieces, self.trained):
            if out and out[-1][1] == t:
                out[-1] = (out[-1][0] + piece, t)
            else:
                out.append((piece, t))
        return [s for s in out if s[0]]


class LossView:
    """A model's tokenizer and chat template with the recipe's settings: `mark(example)` gives what the loss sees."""

    def __init__(self, model: str, settings: Settings):
        from launcher.data.dataset import _template_env
        from launcher.data.tokenizer import read_tokenizer, tokenizer_dir

        folder, why = tokenizer_dir(model)
        read = read_tokenizer(folder) if folder else None
        if read is None:
            raise LookupError(why or f"{folder} has no tokenizer.json")
        self.model, self.settings = model, settings
        self.tokenizer, self.special, self.added = read.tokenizer, read.special, read.added
        self.added_ids = set(self.added.values())
        self.eos = settings.eos_token or self.special.get("eos_token")
        self.template_source = read.template
        self.template = self._training_template(read.template) if read.template else None
        self.compiled = _template_env().from_string(self.template) if self.template else None
        self.eot = self._end_of_turn()

    def _training_template(self, template: str) -> str:
        """TRL's training template for assistant_only_loss where the model's has no {% generation %} markers
        (get_training_chat_template: an exact match); else a DataError."""
        # the statement keywords the template uses ({% generation %} -> 'generation')
        if not self.settings.assistant_only_loss or "generation" in re.findall(r"{%-?\s*(\w+)", template):
            return template
        folder = _trl_templates()
        if folder is not None:
            for original in sorted(folder.glob("*.jinja")):
                training = original.with_name(original.stem + "_training.jinja")
                if training.is_file() and original.read_text(encoding="utf-8") == template:
                    return training.read_text(encoding="utf-8")
        raise DataError(
            f"assistant_only_loss: the chat template of {self.model} has no {{% generation %}} markers, and TRL has no "
            "training template for it, so no token would be trained (TRL stops at the first example)",
            fix="wrap each assistant turn of the template, its end-of-turn token included, in {% generation %} ... "
            "{% endgeneration %} (chat_template.jinja in the model folder), or set assistant_only_loss: false.",
        )

    def _end_of_turn(self) -> Optional[str]:
        """The first special token the template writes after an answer (<|im_end|>, ...); else the EOS TRL appends."""
        if self.compiled is None:
            return self.eos
        probe = [{"role": "user", "content": PROBE_QUESTION}, {"role": "assistant", "content": PROBE_ANSWER}]
        for messages in (probe, [{"role": "system", "content": "s"}, *probe]):
            try:
                text = self._render(messages, None, False)[0]
            except Exception:  # a template that wants another shape of conversation: the next probe
                continue
            end = text.find(PROBE_ANSWER)
            if end < 0:
                continue
            rest = text[end + len(PROBE_ANSWER) :].lstrip()
            return next((tok for tok in sorted(self.added, key=len, reverse=True) if rest.startswith(tok)), None)
        return None

    def stop_ids(self) -> set[int]:
        return {self.added[t] for t in (self.eot, self.eos) if t in self.added}

    def _render(self, messages, tools, generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        from launcher.data.dataset import render_tracked

        # transformers drops the keys whose value is None before rendering (_normalize_chat_messages)
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return render_tracked(
            self.compiled, messages=msgs, tools=tools, add_generation_prompt=generation_prompt, **self.special
        )

    def mark(self, example: dict[str, Any]) -> Marked:
        s = self.settings
        conversational = formats.conversational(example)
        if conversational and self.compiled is None:
            raise DataError(
                f"{self.model} has no chat template, and the data is chat (messages): the trainer cannot render it",
                fix="train a model with a chat template (an instruct model), add one to the model folder "
                "(chat_template.jinja), or give the data as text or plain prompt/completion.",
            )
        masks: list[list[int]] = []
        if conversational:
            messages = example["messages"] if "messages" in example else example["prompt"] + example["completion"]
            text, spans = self._render(messages, example.get("tools"), False)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            ids, offsets = enc.ids, enc.offsets
            if "prompt" in example:
                prompt = self._render(example["prompt"], example.get("tools"), True)[0]
                masks += self._completion_mask(self.tokenizer.encode(prompt, add_special_tokens=False).ids, ids)
            if s.assistant_only_loss:
                masks.append(_assistant_mask(offsets, spans))
        else:
            eos = self.eos or ""
            if "text" in example:
                text = example["text"] if example["text"].endswith(eos) else example["text"] + eos
            else:
                completion = example["completion"]
                text = example["prompt"] + (completion if completion.endswith(eos) else completion + eos)
            enc = self.tokenizer.encode(text, add_special_tokens=True)
            ids, offsets = enc.ids, enc.offsets
            if "prompt" in example:
                prompt_ids = self.tokenizer.encode(example["prompt"], add_special_tokens=True).ids
                masks += self._completion_mask(prompt_ids, ids)
        labelled = [all(m[i] for m in masks) for i in range(len(ids))]  # build_labels: every applicable mask
        unmasked = not any(labelled)
        length = len(ids)
        keep = slice(0, length)
        if s.max_length is not None and length > s.max_length and (not s.packing or s.packing_strategy == "bfd"):
            # _prepare_dataset truncates (keep_start or keep_end); BFD packing truncates each sequence the same way
            keep_end = s.truncation_mode == "keep_end" and not s.packing
            keep = slice(length - s.max_length, length) if keep_end else slice(0, s.max_length)
        cut = any(labelled[: keep.start]) or any(labelled[keep.stop :])
        ids, offsets, labelled = ids[keep], offsets[keep], labelled[keep]
        trained = [t and i > 0 for i, t in enumerate(labelled)]  # the first token of a sequence is never a target
        pieces = self._pieces(text, ids, offsets)
        marked = Marked(ids, trained, pieces, length, cut, not any(trained), unmasked, [])
        marked.ends = self._run_ends(example, marked)
        return marked

    def _completion_mask(self, prompt_ids: list[int], ids: list[int]) -> list[list[int]]:
        """Trained from where the prompt and the whole example diverge, unless completion_only_loss is false."""
        if self.settings.completion_only_loss is False:
            return []
        n = 0
        while n < min(len(prompt_ids), len(ids)) and prompt_ids[n] == ids[n]:
            n += 1
        return [[0] * n + [1] * (len(ids) - n)]

    def _pieces(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> list[str]:
        """Each token's characters in the rendered text; a token with none of its own (an added BOS, a byte of a
        shared character) shows its own form only when it is special."""
        pieces, seen = [], offsets[0][0] if offsets else 0
        for tid, (start, end) in zip(ids, offsets):
            if end <= seen or start == end:
                pieces.append(self.tokenizer.id_to_token(tid) if tid in self.added_ids and start == end else "")
                continue
            pieces.append(text[max(start, seen) : end])
            seen = end
        return pieces

    def _run_ends(self, example: dict[str, Any], m: Marked) -> list[int]:
        """The index of the last non-blank token of each trained run that must end a turn: every run where only
        answers train; else the last, where the conversation ends with the assistant."""
        runs, start = [], None
        for i, t in enumerate(m.trained + [False]):
            if t and start is None:
                start = i
            elif not t and start is not None:
                runs.append((start, i))
                start = None
        if not runs:
            return []
        masked = self.settings.assistant_only_loss or "prompt" in example
        if not masked:
            msgs = formats.conversation(example) if formats.conversational(example) else None
            if msgs is not None and msgs[-1].get("role") != "assistant":
                return []
            runs = runs[-1:]
        blank = [not (p.strip() or i in self.added_ids) for p, i in zip(m.pieces, m.ids)]
        return [next((i for i in range(b - 1, a - 1, -1) if not blank[i]), b - 1) for a, b in runs]


def _trl_templates() -> Optional[Path]:
    """trl's chat_templates folder, found without importing trl (which imports torch)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "chat_templates"
    return folder if folder.is_dir() else None


def _assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Every token overlapping a {% generation %} block (transformers 5.24 return_assistant_tokens_mask)."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def percentile(values: list[int], q: float) -> int:
    """The nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else 0


# A left-out assistant_only_loss trains the answers where the template can mark them, as the other tools default to
ANSWERS_ONLY_WHY = (
    "the default where the chat template marks the answers, as LLaMA-Factory (train_on_prompt: false) and Axolotl "
    "(train_on_inputs: false) train; assistant_only_loss: false trains the whole conversation"
)


def resolve_answers_only(
    model: str, settings: Settings, examples: list[Any], where: Optional[list[str]] = None
) -> tuple[Settings, str]:
    """The settings with a left-out assistant_only_loss resolved, and why: on for chat data whose template marks
    the answers with the end-of-turn token inside them; off otherwise."""
    if settings.assistant_only_loss:
        plain = next((e for e in examples if isinstance(e, dict) and not formats.conversational(e)), None)
        if plain is not None:  # trl 1.16 SFTTrainer.__init__ raises on it, after the model has loaded
            raise DataError(
                f"assistant_only_loss: true, and the data is {formats.FORMS[formats.example_form(plain)].reads_as} "
                "without a chat template: TRL marks the assistant turns of conversations only",
                fix="remove assistant_only_loss (plain prompt/completion data train the completion, plain text every "
                "token), or give the data as chat messages.",
            )
    if settings.assistant_only_loss is not None:
        return settings, ""
    off = replace(settings, assistant_only_loss=False)
    where = where or [f"example {i + 1}" for i in range(len(examples))]
    places = [w for e, w in zip(examples, where) if isinstance(e, list) or (isinstance(e, dict) and "messages" in e)]
    chat = [e for e in examples if isinstance(e, list) or (isinstance(e, dict) and "messages" in e)]
    if not chat:
        return off, ""
    if settings.packing:
        return off, "packing: true, which ftrun does not combine with answers-only loss"
    on = replace(settings, assistant_only_loss=True)
    try:
        view = LossView(model, on)
    except LookupError as exc:
        return off, f"the model's tokenizer is not on this machine to check its chat template ({exc})"
    except DataError:
        return off, (
            f"the chat template of {model} has no {{% generation %}} markers and TRL has no training template for it, "
            "so the answers cannot be told from the prompt"
        )
    chat = [{"messages": e} if isinstance(e, list) else e for e in chat]
    if view.template != view.template_source:
        differs = _swapped_template_differs(view, chat)
        if differs is not None:
            return off, (
                f"TRL's training template for {model} renders {places[differs]} otherwise than the model's own "
                "template (the one it is served with: trl 1.16's qwen3_training.jinja writes a thinking block into "
                "every earlier answer, for one), so the model would learn from prompts it is never asked"
            )
    try:
        marked = view.mark(chat[0])
    except Exception:  # the template refuses the record: the check that follows names it
        return on, ANSWERS_ONLY_WHY
    if not marked.cut and any(marked.ids[end] not in view.stop_ids() for end in marked.ends):
        return off, (
            f"the {{% generation %}} blocks of the chat template of {model} leave the end-of-turn token "
            f"{view.eot or view.eos} out, so answers-only loss would never teach the model to stop"
        )
    return on, ANSWERS_ONLY_WHY


def _swapped_template_differs(view: LossView, chat: list[dict[str, Any]]) -> Optional[int]:
    """The index of the first conversation that TRL's swapped-in training template renders otherwise than the
    model's own, or None (trl 1.16 qwen3_training.jinja: thinking in every turn; trl/chat_templates/README.md)."""
    from launcher.data.dataset import _template_env

    own = _template_env().from_string(view.template_source)
    for i, ex in enumerate(chat):
        msgs = [{k: v for k, v in m.items() if v is not None} for m in ex["messages"]]
        try:
            a = own.render(messages=msgs, tools=ex.get("tools"), add_generation_prompt=False, **view.special)
            b = view.compiled.render(messages=msgs, tools=ex.get("tools"), add_generation_prompt=False, **view.special)
        except Exception:  # a record the template refuses: the check that follows names it
            continue
        if a != b:
            return i
    return None


def check(
    model: str,
    settings: Settings,
    examples: list[Any],
    where: list[str],
    origin: Optional[list[int]] = None,
    sources: Optional[list[str]] = None,
) -> Optional[dict[str, Any]]:
    """Every example marked; a DataError where too many train nothing, miss the end-of-turn token or are cut. The
    record the run keeps (data.json "loss_view"), or None without the model's tokenizer on this machine."""
    settings, why = resolve_answers_only(model, settings, examples, where)
    try:
        view = LossView(model, settings)
    except LookupError:
        return None
    examples = [{"messages": e} if isinstance(e, list) else e for e in examples]
    origin = origin or [0] * len(examples)
    marks: list[Marked] = []
    for ex, w in zip(examples, where):
        try:
            marks.append(view.mark(ex))
        except DataError:
            raise
        except Exception as exc:  # the template refuses this record: the count already named such records
            raise DataError(
                f"the chat template of {model} could not render {w}: {exc}",
                fix="check that the model's chat template supports what this record holds.",
            ) from None
    n = len(marks)
    _refuse_empty(view, examples, where, marks)
    _refuse_no_stop(view, where, marks, view.stop_ids())
    _refuse_cut(view, where, marks, texts=all("text" in ex for ex in examples))
    from launcher.data import served_check

    # the prompt a chat endpoint renders against the one trained, as the export checks it after training
    served = served_check.check(view, examples, where)
    lengths = [m.length for m in marks]
    kept = sum(len(m.ids) for m in marks)
    trained = sum(sum(m.trained) for m in marks)
    shown = []
    for k in sorted(set(origin)):
        i = next((j for j in range(n) if origin[j] == k and not marks[j].empty), origin.index(k))
        shown.append(
            {
                "where": where[i],
                "source": (sources or [None])[k] if sources and k < len(sources) else None,
                "tokens": len(marks[i].ids),
                "trained": sum(marks[i].trained),
                "segments": [[text, t] for text, t in marks[i].segments()],
            }
        )
    return {
        "examples": shown,
        **({"served_prompt": served} if served else {}),
        # plain text and plain prompt/completion end with the EOS TRL appends (add_eos), not the template's end of turn
        "end_of_turn": view.eos if not any(formats.conversational(ex) for ex in examples) else view.eot,
        "mode": _mode(view, examples[0], why),
        "assistant_only_loss": bool(settings.assistant_only_loss),
        "stats": {
            "examples": n,
            "tokens": kept,
            "trained_tokens": trained,
            "trained_share": round(trained / kept, 4) if kept else 0.0,
            **{f"p{q}": percentile(lengths, q) for q in (50, 90, 99)},
            "max": max(lengths) if lengths else 0,
            "max_length": settings.max_length,
            "truncated": sum(1 for x in lengths if settings.max_length and x > settings.max_length),
            "cut": sum(m.cut for m in marks),
            "empty": sum(m.empty for m in marks),
        },
        "trained_each": [sum(m.trained) for m in marks],  # per example, for the caller's own figures (not kept)
    }


def _mode(view: LossView, example: dict[str, Any], why: str = "") -> str:
    """What the loss trains, and why (`why`: how a left-out assistant_only_loss was resolved)."""
    if view.settings.assistant_only_loss:
        return f"assistant turns only ({why or 'assistant_only_loss'})"
    if "prompt" in example and view.settings.completion_only_loss is not False:
        return "the completion only"
    if "text" in example:
        return "every token (plain text)"
    if why:
        return f"the whole conversation (assistant_only_loss left out, and answers-only loss cannot be had: {why})"
    return "the whole conversation (assistant_only_loss: false)"


def _shown(view: LossView, m: Marked) -> str:
    """The example that shows a refusal, in brackets (an error goes to stderr, often a log)."""
    return render_segments(m.segments(), color=False)


def _refuse_empty(view: LossView, examples, where, marks: list[Marked]) -> None:
    s = view.settings
    if s.assistant_only_loss:
        bad = [i for i, m in enumerate(marks) if m.unmasked]
        if bad:  # TRL raises on the first such example ("at least one example has no assistant tokens")
            i = bad[0]
            raise DataError(
                f"{where[i]}: no token is trained: assistant_only_loss trains the template's {{% generation %}} "
                f"blocks, and this example has none ({len(bad)} of {len(marks)} examples; TRL stops at the first):\n"
                + _shown(view, marks[i]),
                fix="give every example an assistant turn, or set assistant_only_loss: false.",
            )
    bad = [i for i, m in enumerate(marks) if m.empty]
    if len(bad) > EMPTY_SHARE_LIMIT * len(marks):
        i = bad[0]
        m = marks[i]
        why = (
            f"max_length {s.max_length} keeps only its first {len(m.ids)} of {m.length} tokens, none of them trained"
            if m.length > len(m.ids)
            else "the masking leaves no token to train"
        )
        need = percentile([x.length for x in marks], 99)
        raise DataError(
            f"{where[i]}: no token of this example is trained ({why}); {len(bad)} of {len(marks)} examples "
            f"({len(bad) / len(marks):.1%}) train nothing, more than the {EMPTY_SHARE_LIMIT:.0%} allowed "
            f"(loss_view.EMPTY_SHARE_LIMIT); TRL would drop them silently:\n" + _shown(view, m),
            fix=f"raise max_length (max_length={need} keeps 99% of the examples whole), shorten the prompts, or "
            "remove these examples.",
        )


def _refuse_no_stop(view: LossView, where, marks: list[Marked], stops: set[int]) -> None:
    for i, m in enumerate(marks):
        if m.cut:
            continue  # the cut check speaks for these
        for end in m.ends:
            if m.ids[end] in stops:
                continue
            eot = view.eot or view.eos
            found, k = "", end
            while k >= 0 and m.trained[k] and len(found) < 16:  # the end of the trained text
                found = m.pieces[k] + found
                k -= 1
            if view.eot is None and view.compiled is not None:
                why = "the chat template writes no end-of-turn token after an assistant turn"
            elif eot is not None and eot not in view.added:
                why = (
                    f"the end-of-turn text {eot!r} is not one token of the tokenizer (it is split into "
                    f"{len(view.tokenizer.encode(eot, add_special_tokens=False).ids)} pieces)"
                )
            else:
                why = f"the template's end-of-turn token {eot} is not in the trained part"
            raise DataError(
                f"{where[i]}: the trained part of an assistant turn ends with {found!r}, not with the end-of-turn "
                f"token ({why}), so the model never learns to stop:\n" + _shown(view, m),
                fix="put the end-of-turn token inside the {% generation %} block of the chat template (or set "
                "assistant_only_loss: false), or use a tokenizer whose EOS is one special token.",
            )


def _refuse_cut(view: LossView, where, marks: list[Marked], texts: bool = False) -> None:
    """Too many trained parts cut by max_length; `texts`: the data is plain text (continued pre-training)."""
    s = view.settings
    bad = [i for i, m in enumerate(marks) if m.cut]
    if len(bad) <= s.may_cut * len(marks):
        return
    lengths = [m.length for m in marks]
    i = bad[0]
    kept, total = sum(len(m.ids) for m in marks), sum(lengths)
    if texts:
        # packing with splitting keeps a cut document's rest (trl 1.16 data_utils.py pack_dataset "bfd_split")
        raise DataError(
            f"{where[i]}: max_length {s.max_length} cuts {len(bad)} of {len(marks)} documents "
            f"({len(bad) / len(marks):.1%}, more than max_length_may_cut={s.may_cut:g} allows); this one has "
            f"{marks[i].length:,} tokens: training would keep {kept:,} of the data's {total:,} tokens, each "
            "long document's start alone",
            fix=f"pack with splitting: packing: true and trainer: {{packing_strategy: bfd_split}} (TRL cuts each "
            f"document into pieces of max_length and packs them: all {total:,} tokens train, no document loses its "
            f"end); or raise max_length ({max(lengths)} keeps every document whole); or allow the cuts with "
            f"max_length_may_cut={len(bad) / len(marks):.2f} (each keeps its first {s.max_length} tokens only).",
        )
    raise DataError(
        f"{where[i]}: max_length {s.max_length} cuts the trained part of {len(bad)} of {len(marks)} examples "
        f"({len(bad) / len(marks):.1%}, more than max_length_may_cut={s.may_cut:g} allows); this one "
        f"has {marks[i].length} tokens, and its answer loses its end and its end-of-turn token:\n"
        + _shown(view, marks[i]),
        fix=f"raise max_length: {percentile(lengths, 99)} keeps 99% of the examples whole (p99), {max(lengths)} keeps "
        "all of them; or shorten or remove the long examples; or allow more cut answers with "
        f"max_length_may_cut={len(bad) / len(marks):.2f} (they train without their end).",
    )


TRAINED_STYLE, CONTEXT_STYLE, RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[0m"


def render_segments(segments, color: bool = False, limit: Optional[int] = SHOWN_CHARS) -> str:
    """[(text, trained), ...] as one text, trained spans in [[...]] (bold green on a terminal), the middle elided."""
    segments = [(str(t), bool(tr)) for t, tr in segments]
    total = sum(len(t) for t, _ in segments)
    if limit and total > limit:
        head, tail = limit * 2 // 3, limit // 3
        middle = [(f" ... ({total - head - tail:,} characters) ... ", None)]
        segments = _slice(segments, 0, head) + middle + _slice(segments, total - tail, total)
    out = []
    for text, trained in segments:
        if trained is None:
            out.append(text)
        elif color:
            out.append((TRAINED_STYLE if trained else CONTEXT_STYLE) + text + RESET)
        else:
            out.append(f"{OPEN}{text}{CLOSE}" if trained else text)
    return "".join(out)


def _slice(segments, start: int, stop: int):
    out, pos = [], 0
    for text, trained in segments:
        a, b = max(start, pos), min(stop, pos + len(text))
        if a < b:
            out.append((text[a - pos : b - pos], trained))
        pos += len(text)
    return out
