"""What training puts in front of an answer, and the template switches that ask it (launcher/data/chat_prompt.py):
the task evaluation asks each scorer with them, as the export serves (tests/deliver/test_served_prompt.py has the
export's side)."""

from __future__ import annotations


def _prompts(answers):
    return [
        {"index": i, "messages": [{"role": "user", "content": q}], "reference": a}
        for i, (q, a) in enumerate(zip(["The capital of France?", "What is 2 + 2?"], answers))
    ]


def test_qwen3_task_prompts_ask_with_thinking_off_when_the_answers_do_not_reason(tmp_path):
    from transformers import AutoTokenizer

    from chat_templates import build_tokenizer
    from launcher.data.chat_prompt import task_switches
    from launcher.worker.task_eval import prompt_text

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "qwen3", "qwen3")))
    plain = _prompts(["Paris.", "4."])
    assert task_switches(tok, plain) == {"enable_thinking": False}
    assert prompt_text(tok, plain[0], {"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    reasoning = _prompts(["<think>\nThe capital.\n</think>\n\nParis.", "<think>\nAdd.\n</think>\n\n4."])
    assert task_switches(tok, reasoning) == {}


def test_templates_without_switches_and_plain_text_ask_as_they_are(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from launcher.data.chat_prompt import task_switches

    assert task_switches(AutoTokenizer.from_pretrained(str(tiny_model)), _prompts(["Paris.", "4."])) == {}
    assert task_switches(AutoTokenizer.from_pretrained(str(tiny_model)), [{"text": "a", "reference": "b"}]) == {}
