"""The demo's GRPO step's second reward (recipes/tiny-cpu-grpo.yaml), called as TRL's GRPOTrainer calls a reward
function: `length_match(prompts, completions, reference=[...], **columns)`, one float per completion."""


def _text(completion) -> str:
    """A sampled answer's text: a conversational completion is [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def length_match(prompts, completions, reference=None, **kwargs):
    """1.0 for an answer as long as its reference (in characters), falling linearly to 0 at twice its length or
    none; None where a prompt has no reference. The task metric alone (chrF, which weighs recall twice as much as
    precision) let the tiny model learn to run on to the length cap: its sampled answers' chrF rose while its greedy
    answers turned into "assistant assistant ... reversed is the capital of" and the task score fell (28% -> 21%)."""
    refs = reference if reference is not None else [None] * len(completions)
    out = []
    for completion, ref in zip(completions, refs):
        if ref is None:
            out.append(None)
            continue
        want, got = max(1, len(str(ref).strip())), len(_text(completion).strip())
        out.append(max(0.0, 1.0 - abs(got - want) / want))
    return out
