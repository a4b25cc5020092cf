"""Build the demo's GRPO prompts (recipes/data/tiny-prompts.jsonl) from its chat data (recipes/data/tiny-chat.jsonl).

GRPO samples its own answers and is rewarded by a check that can be verified: each row is a prompt (one
conversation's turns before its last assistant turn) with that turn as the reference answer, kept where the answer is
short (capitals, sums, reversed words), so the task metric's reward (chrF against the reference) is computed on a CPU
within the demo's minute and the tiny SFT model already earns some of it. Run:
python scripts/make_prompt_data.py recipes/data/tiny-chat.jsonl recipes/data/tiny-prompts.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_WORDS = 8  # longer answers (ticket replies, counting) need more new tokens than the demo samples


def prompts(conversations: list[list[dict]]) -> list[dict]:
    out = []
    for messages in conversations:
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        answer = messages[last]["content"]
        if len(answer.split()) <= MAX_WORDS:
            out.append({"prompt": messages[:last], "reference": answer})
    return out


def main(src: str, dst: str) -> None:
    rows = [json.loads(line)["messages"] for line in Path(src).read_text().splitlines() if line.strip()]
    with Path(dst).open("w", encoding="utf-8") as fh:
        for row in prompts(rows):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
