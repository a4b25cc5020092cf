#!/usr/bin/env python3
"""Generate the small, deterministic synthetic chat dataset that ftrun's tests and demo train on."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "recipes" / "data" / "tiny-chat.jsonl"

# Closed, repetitive vocabularies on purpose: a random-init model of ~100k parameters must be able to
# memorise the mapping (capital, sum, reversal, ticket reply) within a few hundred steps, so the loss
# curve in the demo visibly falls.
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Greece", "Athens"),
    ("Ireland", "Dublin"),
    ("India", "New Delhi"),
    ("China", "Beijing"),
    ("Brazil", "Brasilia"),
    ("Mexico", "Mexico City"),
    ("Cuba", "Havana"),
    ("Ghana", "Accra"),
]

WORDS = [
    "cat",
    "dog",
    "tree",
    "lamp",
    "river",
    "stone",
    "cloud",
    "apple",
    "train",
    "glass",
    "paper",
    "light",
    "music",
    "table",
    "house",
    "green",
    "sugar",
    "plant",
    "bread",
    "chair",
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly and correctly.",
    "You are the support assistant for Acme Cloud. Be polite, give numbered steps when there are several, "
    "and always mention the ticket number.",
    "You are a patient tutor. Answer the question directly, then stop.",
]

# Support tickets: (problem phrasings, canonical answer steps). The answer is a fixed function of the
# problem so it is learnable; the phrasing varies so the model sees more than one surface form.
TICKETS = [
    (
        ["I can't log in to my account.", "Login keeps failing for me.", "My password is not accepted anymore."],
        [
            "Open the login page and click Forgot password.",
            "Check your email for the reset link.",
            "Choose a new password and sign in again.",
        ],
    ),
    (
        ["I was charged twice this month.", "There is a double charge on my card.", "My invoice shows two payments."],
        [
            "Open Billing and select the invoice.",
            "Click Request refund on the duplicate payment.",
            "The refund reaches your card within five days.",
        ],
    ),
    (
        ["My server is very slow.", "The dashboard takes ages to load.", "Everything is slow since this morning."],
        [
            "Open the Status page to check for incidents.",
            "Restart the instance from the dashboard.",
            "If it is still slow, send us the instance id.",
        ],
    ),
    (
        ["How do I delete my account?", "Please close my account.", "I want to remove my account."],
        [
            "Open Settings and choose Account.",
            "Click Delete account and confirm.",
            "Your data is removed after thirty days.",
        ],
    ),
    (
        ["I did not get the confirmation email.", "The verification mail never arrived.", "No email from you yet."],
        [
            "Check your spam folder first.",
            "Click Resend email on the sign up page.",
            "Add our address to your contacts.",
        ],
    ),
]


def _capital(rng: random.Random) -> tuple[str, str]:
    country, city = rng.choice(CAPITALS)
    q = rng.choice(
        [
            f"What is the capital of {country}?",
            f"Name the capital city of {country}.",
            f"Which city is the capital of {country}?",
            f"capital of {country}?",
        ]
    )
    a = rng.choice([f"The capital of {country} is {city}.", f"{city} is the capital of {country}."])
    return q, a


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    x, y = rng.randint(0, 20), rng.randint(0, 20)
    op = rng.choice(["plus", "minus", "times"])
    z = {"plus": x + y, "minus": x - y, "times": x * y}[op]
    sym = {"plus": "+", "minus": "-", "times": "*"}[op]
    q = rng.choice([f"What is {x} {op} {y}?", f"Compute {x} {sym} {y}.", f"{x} {sym} {y} = ?"])
    return q, rng.choice(["", "Sure. ", "Easy: ", "The answer: "]) + f"{x} {sym} {y} = {z}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    q = rng.choice([f"Reverse the word {word}.", f"Spell {word} backwards.", f"Write {word} in reverse."])
    return q, f"{word} reversed is {word[::-1]}."


def _ticket(rng: random.Random) -> tuple[str, str]:
    problems, steps = rng.choice(TICKETS)
    ticket_id = rng.randint(1000, 9999)
    q = f"Ticket {ticket_id}: {rng.choice(problems)}"
    if rng.random() < 0.5:
        q += " " + rng.choice(["Please help.", "This is urgent.", "Thanks in advance.", "Any idea?"])
    body = "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1))
    return q, f"Sorry about that. Here is what to do for ticket {ticket_id}:\n{body}"


def _long(rng: random.Random) -> tuple[str, str]:
    # The long tail: a few hundred tokens, so packing, truncation and bucketing have something real to do.
    kind = rng.choice(["count", "capitals", "log"])
    if kind == "count":
        start = rng.randint(1, 50)
        n = rng.randint(60, 220)
        return f"Count from {start} to {start + n - 1}.", ", ".join(str(i) for i in range(start, start + n)) + "."
    if kind == "capitals":
        pairs = rng.sample(CAPITALS, rng.randint(12, len(CAPITALS)))
        return (
            "List these countries with their capitals: " + ", ".join(c for c, _ in pairs) + ".",
            "\n".join(f"- {c}: {city}" for c, city in pairs),
        )
    lines = []
    for i in range(rng.randint(15, 40)):
        level = rng.choice(["INFO", "INFO", "INFO", "WARN", "ERROR"])
        lines.append(f"12:{i:02d} {level} worker {rng.randint(1, 4)} step {i * 10} done")
    errors = sum(1 for line in lines if " ERROR " in line)
    warns = sum(1 for line in lines if " WARN " in line)
    return (
        "Summarize this log:\n" + "\n".join(lines),
        f"The log has {len(lines)} lines, {errors} errors and {warns} warnings.",
    )


def make_examples(n: int = 400, seed: int = 0) -> list[dict]:
    """Return n chat examples; the same (n, seed) always gives the same list."""
    rng = random.Random(seed)
    short_makers = [_capital, _arithmetic, _reverse, _ticket]
    examples = []
    for _ in range(n):
        maker = _long if rng.random() < 0.05 else rng.choice(short_makers)
        messages = []
        if rng.random() < 0.6:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        # Some conversations have a second or third turn, as real chat data does.
        turns = 1 if maker is _long else rng.choice([1, 1, 1, 2, 2, 3])
        for turn in range(turns):
            user, assistant = maker(rng) if turn == 0 else rng.choice(short_makers)(rng)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        examples.append({"messages": messages})
    return examples


def write_jsonl(path: Path, examples: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", nargs="?", default=str(DEFAULT_OUT), help="output .jsonl (default: %(default)s)")
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = write_jsonl(Path(args.out), make_examples(args.examples, args.seed))
    print(f"wrote {args.examples} examples to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
