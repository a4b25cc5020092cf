"""The served prompt checked before training: for one conversation of each shape in the data, the tokens the training
puts in front of the last answer against the prompt a chat endpoint renders for the same turns, as the export checks
them after training (docs/evaluation.md, "After the export"), with the same functions (chat_prompt.py).

The training side is the template TRL trains with (the model's own, or TRL's training template: loss_view.py); the
serving side the model's own with its chat-template switches. Both rendered with jinja2 and tokenizer.json, as
transformers renders them. A prompt that differs is a DataError before any GPU time.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Optional

from launcher.data import formats
from launcher.data.chat_prompt import TEMPLATE_SWITCHES, generation_ids, shape, switches, trained_context
from launcher.errors import DataError

# conversation shapes checked, the most frequent first (the export checks as many: served_prompt.py MAX_SHAPES)
MAX_SHAPES = 24
CONTEXT_TOKENS = 8  # tokens shown before the first difference


class LightTokenizer:
    """The two calls of a transformers tokenizer the served-prompt functions make (apply_chat_template, __call__),
    answered without transformers, rendered as transformers 5.24 renders (None-valued keys dropped)."""

    def __init__(self, view):
        from launcher.data.dataset import _template_env

        self._tokenizer = view.tokenizer
        self._special = view.special
        self.chat_template = view.template_source
        self._env = _template_env()
        self._compiled: dict[str, Any] = {}

    def _template(self, source: Optional[str]):
        source = source or self.chat_template
        if source not in self._compiled:
            self._compiled[source] = self._env.from_string(source)
        return self._compiled[source]

    def apply_chat_template(
        self,
        messages,
        tools=None,
        tokenize: bool = True,
        return_dict: bool = False,
        add_generation_prompt: bool = False,
        chat_template: Optional[str] = None,
        **kwargs,
    ):
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._template(chat_template).render(
            messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt, **self._special, **kwargs
        )
        if not tokenize:
            return text
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return {"input_ids": ids} if return_dict else ids

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False):
        enc = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out: dict[str, Any] = {"input_ids": enc.ids}
        if return_offsets_mapping:
            out["offset_mapping"] = enc.offsets
        return out

    def token(self, i: int) -> str:
        return self._tokenizer.id_to_token(int(i)) or f"<{i}>"

    def text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def _chosen(examples: list[dict[str, Any]], where: list[str]) -> list[tuple[list[dict], Any, str]]:
    """One conversation of each shape, the most frequent first: (turns, tools, where)."""
    convs = []
    for ex, w in zip(examples, where):
        if not formats.conversational(ex):
            continue
        conv = formats.conversation(formats.sequences(ex)[0])  # a pair: its prompt and the chosen answer
        tools = ex.get("tools")
        convs.append((conv, json.loads(tools) if isinstance(tools, str) else tools, w))
    counts = Counter(shape(c) for c, _, _ in convs)
    first: dict[str, tuple] = {}
    for item in convs:
        first.setdefault(shape(item[0]), item)
    return [first[sh] for sh, _ in counts.most_common(MAX_SHAPES)]


def check(view, examples: list[dict[str, Any]], where: list[str]) -> Optional[dict]:
    """The served prompt of each shape against the trained one: a DataError at the first that differs."""
    if view.compiled is None:
        return None
    chosen = _chosen(examples, where)
    if not chosen:
        return None
    tok = LightTokenizer(view)
    swapped = view.template != view.template_source
    training = view.template if swapped else None
    prompts, unrendered = [], []
    for conv, tools, w in chosen:
        last = max((i for i, m in enumerate(conv) if m["role"] == "assistant"), default=len(conv))
        prompt = conv[:last] or conv[:1]
        kw = {"tools": tools, "chat_template": training}
        try:
            ctx = trained_context(tok, conv, last, kw) if last < len(conv) else None
            if ctx is None:  # the answer not written verbatim: the training template's generation prompt, as the export
                ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **kw)
            else:
                ids = ctx["ids"]
            generation_ids(tok, prompt, tools, {})  # the served side renders this prompt at all
        except Exception:  # noqa: BLE001 - a template that refuses the prompt alone (raise_exception): said, not checked
            unrendered.append(w)
            continue
        prompts.append({"messages": prompt, "tools": tools, "ids": list(ids), "where": w, "shape": shape(conv)})
    if not prompts:
        return {"shapes": 0, "not_rendered": unrendered}
    kwargs = switches(tok, [(p["messages"], p["tools"], p["ids"]) for p in prompts])
    served = [generation_ids(tok, p["messages"], p["tools"], kwargs) for p in prompts]
    diffs = [(p, s) for p, s in zip(prompts, served) if s != p["ids"]]
    if diffs:
        p, s = diffs[0]
        trained = p["ids"]
        i = next((k for k, (a, b) in enumerate(zip(trained, s)) if a != b), min(len(trained), len(s)))
        had = f"{trained[i]} {tok.token(trained[i])!r}" if i < len(trained) else "the end of the prompt"
        got = f"{s[i]} {tok.token(s[i])!r}" if i < len(s) else "the end of the prompt"
        context = tok.text(trained[max(0, i - CONTEXT_TOKENS) : i])
        if swapped:
            why = (
                "assistant_only_loss trains with TRL's training template (its {% generation %} markers), which "
                "writes the turns before the answer otherwise than the model's own template that serves it"
            )
            fix = (
                "train with the template that serves: set assistant_only_loss: false (the model's own template then "
                "trains, the loss on the whole conversation), or give these conversations as prompt/completion "
                "records (the turns before the last answer as 'prompt', the answer as 'completion': TRL trains the "
                "completion alone with the model's own template); or give the model a template with {% generation %} "
                "markers that renders like its serving one (chat_template.jinja in the model folder)"
            )
        else:
            why = "the model's template renders its generation prompt otherwise than the turns before an answer"
            names = [k for k in TEMPLATE_SWITCHES if k in (tok.chat_template or "")]
            fix = (
                "serve and train with one rendering: change the model's chat template (chat_template.jinja in the "
                "model folder) so its generation prompt is what it writes before an assistant turn, or train a model "
                "whose template does" + (f" (tried the template's switches: {', '.join(names)})" if names else "")
            )
        raise DataError(
            f"the served prompt would differ from the trained one: {p['where']} (roles {p['shape']}): the model's "
            f"chat template, as transformers and vLLM serve it (llama.cpp and Ollama read the same template from the "
            f"GGUF), has {got} at token {i} where the training put {had} in front of the answer, after "
            f"{context!r}; identical {len(prompts) - len(diffs)}/{len(prompts)} shapes"
            + (f" (served with {json.dumps(kwargs)})" if kwargs else "")
            + f": {why}, and the export would refuse the result after training",
            fix=fix,
        )
    return {
        "shapes": len(prompts),
        "identical": f"{len(prompts)}/{len(prompts)}",
        "training_template": "TRL's training template (assistant_only_loss)" if swapped else "the model's own template",
        **({"chat_template_kwargs": kwargs} if kwargs else {}),
        **({"not_rendered": unrendered} if unrendered else {}),
    }
