"""Build the demo's preference pairs (recipes/data/tiny-pref.jsonl) from its chat data (recipes/data/tiny-chat.jsonl).

A style preference, the usual second step after SFT: each pair is one conversation's turns before its last assistant
turn (the prompt), that turn as it is (chosen), and the same answer with a chatty closing line added (rejected), one
of a few drawn with a fixed seed. The tiny demo model learns within a minute on a CPU to prefer the answer that
stops, so the reward margin visibly rises. Run:
python scripts/make_preference_data.py recipes/data/tiny-chat.jsonl recipes/data/tiny-pref.jsonl
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


def main(src: str, dst: str) -> None:
    rows = [json.loads(line)["messages"] for line in Path(src).read_text().splitlines() if line.strip()]
    with Path(dst).open("w", encoding="utf-8") as fh:
        for pair in pairs(rows):
            fh.write(json.dumps(pair, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
