"""Build the demo's preference pairs (recipes/data/tiny-pref.jsonl) from its chat data (recipes/data/tiny-chat.jsonl).

A style preference, the usual second step after SFT: each pair is one conversation's turns before its last assistant
turn (the prompt), that turn as it is (chosen), and the same answer with a chatty closing line added (rejected), one
of a few drawn with a fixed seed. The tiny demo model learns within a minute on a CPU to prefer the answer that
stops, so the reward margin visibly rises. Run:
python scripts/make_preference_data.py recipes/data/tiny-chat.jsonl recipes/data/tiny-pref.jsonl

With --unpaired, KTO's unpaired answers instead (TRL's unpaired preference format): each pair's prompt twice, once
with the chosen answer marked desirable (label true) and once with the rejected one marked undesirable (label false),
in a seeded order (the tests build theirs so, from the shipped chat data):
python scripts/make_preference_data.py --unpaired recipes/data/tiny-chat.jsonl OUT.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


FILLER = (
    " I hope this helps! Let me know if you have any other questions, I am always happy to help.",
    " Feel free to ask me anything else, any time: I am here for you and happy to help!",
    " Was this helpful? I would be glad to explain more if you like, just ask me again!",
)


def pairs(conversations: list[list[dict]], seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for messages in conversations:
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        chosen = messages[last]["content"]
        out.append(
            {
                "prompt": messages[:last],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": chosen + rng.choice(FILLER)}],
            }
        )
    return out


def unpaired(conversations: list[list[dict]], seed: int = 7) -> list[dict]:
    """Each pair as two unpaired answers (as trl's unpair_preference_dataset splits one), shuffled with `seed`."""
    rows = [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in pairs(conversations, seed)
        for side in ("chosen", "rejected")
    ]
    random.Random(seed).shuffle(rows)
    return rows


def main(src: str, dst: str, unpair: bool = False) -> None:
    rows = [json.loads(line)["messages"] for line in Path(src).read_text().splitlines() if line.strip()]
    with Path(dst).open("w", encoding="utf-8") as fh:
        for record in unpaired(rows) if unpair else pairs(rows):
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--unpaired"]
    main(args[0], args[1], unpair="--unpaired" in sys.argv[1:])
