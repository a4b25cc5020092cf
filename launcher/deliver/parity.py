"""The parity check: the same prompts through two models, their next-token logits and greedy tokens held to a
tolerance."""

from __future__ import annotations

import math
from typing import Any, Optional

from launcher import gguf_types
from launcher.deliver.messages import ExportError

# prompts taken from the data for the parity checks, and tokens compared per prompt
PARITY_PROMPTS = 3
PARITY_MAX_TOKENS = 128
GREEDY_NEW_TOKENS = 16
# The longest greedy continuation run to see whether a model ends its turn (ending_budget).
ENDING_MAX_TOKENS = 256

# plain argmax, as llama.cpp decodes: generate() would fill unset options from generation_config (transformers 5.24
# generation/utils.py _prepare_generation_config; Qwen2.5's repetition_penalty)
PLAIN_ARGMAX = dict(do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)

# Tolerances: top1 = share of teacher-forced positions with the same next token; rel = max |logit difference| / std
# of the reference logits; ppl = relative perplexity difference; greedy = share of identical greedy continuations.
TOLERANCE = {"merged": {"min_top1": 0.98, "max_rel": 0.15}, "full:merged": {"min_top1": 0.98, "max_rel": 0.15}}
# a GGUF's bounds: its type's tolerance (launcher/gguf_types.py)
TOLERANCE.update({f"gguf:{k}": t.tolerance.as_dict() for k, t in gguf_types.TYPES.items()})
# Both sides in 16 bit (float32 fits nowhere): nearly tied logits can flip, so the merge's check needs more room
# (tiny model, bf16 on the CPU: top-1 0.975 where float32 gives 0.985); a 16-bit GGUF holds the weights exactly.
TOLERANCE_16BIT = {"merged": {"min_top1": 0.95, "max_rel": 0.15}, "full:merged": {"min_top1": 0.95, "max_rel": 0.15}}


def held_out_examples(recipe) -> tuple[list[dict[str, Any]], str]:
    """The examples the export's checks use, and where they come from: held out (eval.data, or eval.fraction's draw
    of launcher/data/split.py) where the recipe holds some out, else the training data."""
    held, source, _ = examples_of(recipe)
    return held, source


def examples_of(recipe, with_data: bool = False) -> tuple[list[dict[str, Any]], str, Optional[list[dict[str, Any]]]]:
    """held_out_examples, and (with_data, or where it is read anyway) the recipe's data as trained, read once."""
    from launcher.data.dataset import load_data

    ev = getattr(recipe, "eval", None)
    seed = getattr(recipe, "seed", 42)
    if ev is not None and getattr(ev, "data", None):
        return (
            load_data(ev.data, seed).examples,
            "held out (eval.data)",
            (load_data(recipe.data, seed).examples if with_data else None),
        )
    raw = load_data(recipe.data, seed).examples  # the mix as trained, split as the worker splits it
    if ev is not None and getattr(ev, "fraction", None):
        from launcher.data.split import for_recipe

        held = for_recipe(raw, recipe).held_out
        if held:
            return [raw[i] for i in held], "held out (eval.fraction)", raw
    return raw, "training data (the recipe holds nothing out)", raw


def parity_examples(recipe) -> tuple[list[list[dict[str, Any]]], str]:
    """The conversations the parity checks use (held_out_examples as lists of messages), and where they come from."""
    from launcher.data import formats as data_formats

    examples, source = held_out_examples(recipe)
    return [data_formats.conversation(e) for e in examples], source


def parity_prompts(
    recipe, tokenizer, n: int = PARITY_PROMPTS, kwargs: Optional[dict[str, Any]] = None
) -> list[dict[str, Any]]:
    """The first n parity conversations: full text (teacher-forced logits) and prompt (greedy decoding, rendered with
    the served switches `kwargs`); `budget`: ending_budget."""
    examples, source = parity_examples(recipe)
    out = []
    for messages in examples[:n]:
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        prompt_msgs = messages[:last_assistant] or messages[:1]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(
            prompt_msgs, tokenize=False, add_generation_prompt=True, **(kwargs or {})
        )
        ids = tokenizer(full, add_special_tokens=False)["input_ids"][:PARITY_MAX_TOKENS]
        all_prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = messages[last_assistant]["content"] if last_assistant < len(messages) else ""
        answer_tokens = len(tokenizer(answer or "", add_special_tokens=False)["input_ids"])
        out.append(
            {
                "text": full,
                "ids": ids,
                "prompt_ids": all_prompt_ids[-PARITY_MAX_TOKENS:],
                "source": source,
                "messages": prompt_msgs,
                "prompt_truncated": len(all_prompt_ids) > PARITY_MAX_TOKENS,
                "budget": ending_budget(answer_tokens),
            }
        )
    return out


def ending_budget(answer_tokens: int) -> int:
    """New tokens a greedy continuation may take to end its turn: the answer's length and GREEDY_NEW_TOKENS more, at
    most ENDING_MAX_TOKENS."""
    return max(GREEDY_NEW_TOKENS, min(answer_tokens + GREEDY_NEW_TOKENS, ENDING_MAX_TOKENS))


def model_outputs(
    model, prompts: list[dict[str, Any]], greedy: bool = True, to_end: bool = False
) -> list[dict[str, Any]]:
    """Per prompt: next-token logits over the whole text (float32) and the greedy continuation (`greedy`: its first
    GREEDY_NEW_TOKENS; with to_end, `continuation` up to the prompt's budget)."""
    import torch

    device = input_device(model)
    results = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p["ids"]], device=device)
            logits = model(input_ids=ids).logits[0].float().cpu()
            tokens = None
            if greedy:
                pid = torch.tensor([p["prompt_ids"]], device=device)
                new = max(GREEDY_NEW_TOKENS, p.get("budget", 0)) if to_end else GREEDY_NEW_TOKENS
                eos = model.config.get_text_config().eos_token_id
                gen = model.generate(
                    input_ids=pid,
                    attention_mask=torch.ones_like(pid),
                    max_new_tokens=new,
                    pad_token_id=eos if isinstance(eos, int) else 0,
                    **PLAIN_ARGMAX,
                )
                tokens = gen[0, pid.shape[1] :].tolist()
            results.append(
                {
                    "logits": logits,
                    "greedy": tokens[:GREEDY_NEW_TOKENS] if tokens is not None else None,
                    "continuation": tokens,
                    "ids": list(p["ids"]),
                }
            )
    return results


def input_device(model):
    """Where the token ids go: a dispatched model's compute device (offloaded weights are on meta), else its own."""
    import torch

    from launcher.deliver.placement import HOST_PLACES

    devices = [d for d in (getattr(model, "hf_device_map", None) or {}).values() if str(d) not in HOST_PLACES]
    if devices:
        d = devices[0]
        return torch.device(f"cuda:{d}" if isinstance(d, int) else d)
    if getattr(model, "hf_device_map", None):
        return torch.device("cpu")
    return next(model.parameters()).device


def compare(
    ref: list[dict[str, Any]], out: list[dict[str, Any]], kind: str, compute: str = "float32"
) -> dict[str, Any]:
    """Numbers for export.json, and whether they are within the tolerance of kind for the compute dtype."""
    import torch

    agree = total = greedy_same = greedy_n = n_nll = 0
    max_abs = max_rel = kl_sum = nll_ref = nll_out = 0.0
    first_diverge = []
    for r, o in zip(ref, out):
        a, b = r["logits"], o["logits"]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        diff = float((a - b).abs().max())
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(float(a.std()), 1e-6))
        kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
        kl_sum += float(kl)
        ids = r.get("ids")
        if ids is not None and len(ids) > 1:
            target = torch.tensor(ids[1:])
            nll_ref += float(torch.nn.functional.cross_entropy(a[:-1], target, reduction="sum"))
            nll_out += float(torch.nn.functional.cross_entropy(b[:-1], target, reduction="sum"))
            n_nll += len(ids) - 1
        if r["greedy"] is not None and o["greedy"] is not None:
            greedy_n += 1
            if r["greedy"] == o["greedy"]:
                greedy_same += 1
            else:
                first_diverge.append(
                    next(i for i, (x, y) in enumerate(zip(r["greedy"] + [None], o["greedy"] + [None])) if x != y)
                )
    tol = TOLERANCE[kind] if compute == "float32" else TOLERANCE_16BIT.get(kind, TOLERANCE[kind])
    top1 = agree / max(total, 1)
    ppl_ref = math.exp(nll_ref / n_nll) if n_nll else None
    ppl_out = math.exp(nll_out / n_nll) if n_nll else None
    ppl_rel = (ppl_out / ppl_ref - 1.0) if n_nll else None
    greedy_share = greedy_same / greedy_n if greedy_n else None
    mean_kl = kl_sum / max(len(ref), 1)
    ok = (
        top1 >= tol["min_top1"]
        and max_rel <= tol.get("max_rel", math.inf)
        and mean_kl <= tol.get("max_kl", math.inf)
        and (ppl_rel is None or abs(ppl_rel) <= tol.get("max_ppl", math.inf))
        and (greedy_share is None or greedy_share >= tol.get("min_greedy", 0.0))
    )
    return {
        "prompts": len(ref),
        "positions": total,
        "top1_agreement": round(top1, 5),
        "max_abs_logit_diff": round(max_abs, 6),
        "max_rel_logit_diff": round(max_rel, 6),
        "mean_kl": round(mean_kl, 8),
        "perplexity_reference": round(ppl_ref, 4) if ppl_ref else None,
        "perplexity": round(ppl_out, 4) if ppl_out else None,
        "perplexity_rel_diff": round(ppl_rel, 6) if ppl_rel is not None else None,
        "greedy_identical": f"{greedy_same}/{greedy_n}",
        "greedy_first_divergence": first_diverge,
        "compute_dtype": compute,
        "tolerance": tol,
        "ok": ok,
    }


def _check(name: str, result: dict[str, Any], fix: Optional[str] = None) -> None:
    if not result["ok"]:
        tol = result["tolerance"]
        parts = [f"top-1 agreement {result['top1_agreement']:.4f} (needs >= {tol['min_top1']})"]
        if "max_kl" in tol:
            parts.append(f"mean KL divergence {result['mean_kl']:.4g} (needs <= {tol['max_kl']})")
        if "max_rel" in tol:
            parts.append(
                f"max relative logit difference {result['max_rel_logit_diff']:.4g} (needs <= {tol['max_rel']})"
            )
        if "max_ppl" in tol and result["perplexity_rel_diff"] is not None:
            parts.append(
                f"perplexity {result['perplexity']:.4g} against {result['perplexity_reference']:.4g} "
                f"({result['perplexity_rel_diff']:+.2%}, needs within {tol['max_ppl']:.1%})"
            )
        if "min_greedy" in tol:
            parts.append(
                f"greedy continuations identical {result['greedy_identical']} (needs >= {tol['min_greedy']:.0%})"
            )
        raise ExportError(
            f"{name} does not match its reference: " + ", ".join(parts) + "; the numbers are in final/export.json",
            fix=fix
            or "do not serve this output. Re-run `ftrun export RUN_DIR` (a truncated write or a full disk "
            "shows like this); if it repeats, report it with export.json.",
        )
