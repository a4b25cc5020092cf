"""Which template Ollama renders a chat with for a model made from a GGUF and a Modelfile, as its source decides.

Modelled on Ollama v0.33.0-rc2 (commit fb30760), the same in v0.30.0 for every case modelled here:
- `ollama create` from a GGUF (server/create.go 403-405, 463-464) calls detectChatTemplate (server/model.go 93-121):
  template.Named (template/template.go 72-91) keeps the entry of template/index.json (copied, with its Go templates,
  to ollama_templates.json here) at the lowest agnivade/levenshtein distance, the first of equals, when under 100.
  A Modelfile TEMPLATE replaces it (server/create.go 828-833, setTemplate 1313-1327).
- At chat time (server/routes.go 2357-2385, 2674-2675) a stored Go template renders the prompt unless
  OLLAMA_GO_TEMPLATE says false or, unset, the GGUF's template has more capabilities (server/images.go 790-795,
  shouldPreferChatTemplate 295-307; capabilities 187-261); else llama-server renders the GGUF's own template
  (llm/llama_server.go 2137-2187).
- A Go template sees the messages collated (template/template.go Execute 257-282, collate 357-374).
Architectures Ollama renders with its own code (server/create.go 795-817) and gpt-oss's harmony (server/routes.go
77-87) are not modelled: `choose` says so.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

DATA = Path(__file__).with_name("ollama_templates.json")
RENDERED_BY_OLLAMA = ("gemma4", "laguna", "nemotron_h", "nemotron_h_moe", "nemotron_h_omni", "gptoss", "gpt-oss")
GO_TEMPLATE_ENV = "OLLAMA_GO_TEMPLATE"


@lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    return json.loads(DATA.read_text(encoding="utf-8"))


def source() -> dict[str, str]:
    """The Ollama version the index was copied from."""
    return dict(_data()["source"])


def distance_below(a: str, b: str, limit: int) -> Optional[int]:
    """The Levenshtein distance of a and b when it is under `limit`, else None: agnivade/levenshtein v1.1.1
    ComputeDistance (template.Named's), unit costs over code points, banded here (no installed package computes
    it). Its uint16 cells wrap past 65535: such strings are refused."""
    if max(len(a), len(b)) > 65535:
        raise ValueError("a template over 65535 code points: Ollama's uint16 distance wraps there")
    if a == b:
        return 0
    if len(a) > len(b):
        a, b = b, a
    if len(b) - len(a) >= limit:
        return None
    inf = limit
    prev = [j if j < limit else inf for j in range(len(a) + 1)]
    for i in range(1, len(b) + 1):
        lo, hi = max(1, i - limit + 1), min(len(a), i + limit - 1)
        cur = [inf] * (len(a) + 1)
        cur[0] = i if i < limit else inf
        ch = b[i - 1]
        for j in range(lo, hi + 1):
            d = prev[j - 1] if a[j - 1] == ch else 1 + min(prev[j - 1], prev[j], cur[j - 1])
            cur[j] = d if d < limit else inf
        if min(cur[max(0, lo - 1) : hi + 1]) >= limit:
            return None
        prev = cur
    return prev[len(a)] if prev[len(a)] < limit else None


def named(chat_template: str) -> Optional[dict[str, Any]]:
    """template.Named: the index entry Ollama autodetects for this chat template (name, Go template, stop values,
    distance), or None when none is under the threshold."""
    data = _data()
    best: Optional[tuple[int, int]] = None
    for k, entry in enumerate(data["index"]):
        d = distance_below(chat_template, entry["template"], data["threshold"] if best is None else best[0])
        if d is not None and (best is None or d < best[0]):  # strictly lower: the first of equals stays
            best = (d, k)
    if best is None:
        return None
    name = data["index"][best[1]]["name"]
    return {"name": name, "distance": best[0], "index_entry": best[1], **data["templates"][name]}


def gguf_capabilities(chat_template: str) -> list[str]:
    """server/images.go chatTemplateCapabilities (187-234): what Ollama reads a Jinja template to offer."""
    caps = []
    if "tools" in chat_template or "tool_call" in chat_template:
        caps.append("tools")
    split = "content.split('</think>')" in chat_template or 'content.split("</think>")' in chat_template
    if ("<think>" in chat_template and "</think>" in chat_template) or (
        split and "reasoning_content" not in chat_template and "<SPECIAL_12>" not in chat_template
    ):
        caps.append("thinking")
    return caps


def _go_fields(template: str) -> set[str]:
    return set(re.findall(r"(?<![\w)])\$?\.([A-Z]\w*)", template))


def choose(
    gguf_template: str,
    modelfile_template: Optional[str],
    architecture: Optional[str],
    go_template_env: Optional[bool] = None,
) -> dict[str, Any]:
    """How Ollama renders a chat for this GGUF and Modelfile: {"path": "go", "template", "from"} (messages collated),
    {"path": "native"} (the GGUF's template through llama-server) or {"path": "not modelled"}; each with `why`.
    `go_template_env`: OLLAMA_GO_TEMPLATE (None: unset)."""
    if (architecture or "") in RENDERED_BY_OLLAMA:
        return {"path": "not modelled", "why": f"Ollama renders {architecture} with its own renderer, not modelled"}
    if modelfile_template:
        go = {"template": modelfile_template, "from": "the Modelfile's TEMPLATE", "stop": None}
    elif gguf_template:
        found = named(gguf_template)
        go = found and {
            "template": found["template"],
            "stop": found["stop"],
            "from": f"Ollama's autodetected {found['name']} template (index entry {found['index_entry']}, "
            f"edit distance {found['distance']} to the GGUF's, under {_data()['threshold']})",
        }
    else:
        go = None
    native = {"path": "native", "why": "the GGUF's own template through llama-server --jinja, messages one to one"}
    if go is None:
        return dict(
            native,
            why=native["why"] + " (no Go template: no Modelfile TEMPLATE and no index entry within "
            f"an edit distance of {_data()['threshold']} of the GGUF's template)",
        )
    if go_template_env is not None:
        if not go_template_env:
            return dict(native, why=native["why"] + f" ({GO_TEMPLATE_ENV}=0 turns the Go template off)")
        return dict(go, path="go", why=f"{go['from']} ({GO_TEMPLATE_ENV}=1)")
    caps_of_go = sorted(_go_fields(go["template"]) & {"Tools", "Thinking", "Suffix"})
    if caps_of_go:  # the preference rule for a Go template with capabilities changed in 0.33: not modelled
        return {
            "path": "not modelled",
            "why": f"{go['from']} uses {', '.join(caps_of_go)}: whether Ollama prefers "
            "it to the GGUF's template differs between versions",
        }
    caps = gguf_capabilities(gguf_template or "")
    if caps:  # more capabilities than a Go template without any: Ollama prefers the GGUF's template
        return dict(
            native,
            why=native["why"] + f" (the GGUF's template offers {' and '.join(caps)}, the Go template "
            f"({go['from']}) none: Ollama prefers the GGUF's)",
        )
    return dict(go, path="go", why=f"{go['from']}, rendered with the messages collated")
