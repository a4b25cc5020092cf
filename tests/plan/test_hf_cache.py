"""ftrun finds a model's files where huggingface_hub itself puts them: HF_HUB_CACHE, else HF_HOME/hub, else
XDG_CACHE_HOME/huggingface/hub (huggingface_hub.constants reads them when it is imported, hence the
subprocesses), through huggingface_hub's own lookup, not a copy of its layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 500}


def _cache_with_model(hub_cache: Path, repo: str = "org/mymodel", sha: str = "0123abcd") -> Path:
    folder = hub_cache / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / sha).mkdir(parents=True)
    (folder / "snapshots" / sha / "config.json").write_text(json.dumps(CONFIG))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(sha)
    return folder / "snapshots" / sha / "config.json"


def _found(env: dict[str, str], tmp_path: Path) -> dict:
    code = (
        "import json; from launcher.model_files import cached_file; from launcher.plan.models import "
        "load_architecture; "
        "a = load_architecture('org/mymodel', allow_network=False); "
        "print(json.dumps({'file': str(cached_file('org/mymodel', 'config.json')), 'layers': a.layers, "
        "'source': a.source}))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME")}
    res = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path / "home"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"])
def test_the_model_cache_is_where_huggingface_hub_keeps_it(tmp_path, variable):
    base = tmp_path / "elsewhere"
    hub_cache = {"HF_HUB_CACHE": base, "HF_HOME": base / "hub", "XDG_CACHE_HOME": base / "huggingface" / "hub"}[
        variable
    ]
    config = _cache_with_model(hub_cache)
    found = _found({variable: str(base)}, tmp_path)
    assert found["file"] == str(config) and found["layers"] == 3 and "cache" in found["source"]


def test_a_config_from_the_hub_comes_through_hf_hub_download(tmp_path, monkeypatch):
    """The Hub fallback is huggingface_hub's download (the user's token, endpoint and cache), and a gated
    repository says how to get access."""
    import huggingface_hub as hf
    import huggingface_hub.constants  # noqa: F401 - a lazy submodule

    from launcher.errors import ModelError
    from launcher.plan.models import load_architecture

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("FTRUN_OFFLINE", raising=False)
    monkeypatch.setattr(hf.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    asked = []

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        if repo_id == "org/gated":
            response_cls = hf.errors.Response
            request_cls = sys.modules[response_cls.__module__.split(".")[0]].Request
            raise hf.errors.GatedRepoError(
                "403: gated",
                response=response_cls(
                    403, request=request_cls("GET", f"https://huggingface.co/{repo_id}/resolve/main/{filename}")
                ),
            )
        return str(_cache_with_model(tmp_path / "cache", repo_id))

    monkeypatch.setattr(hf, "hf_hub_download", download)
    arch = load_architecture("org/new-model")
    assert asked == [("org/new-model", "config.json")] and arch.layers == 3 and "Hub" in arch.source
    with pytest.raises(ModelError, match="gated") as err:
        load_architecture("org/gated")
    assert "hf auth login" in err.value.render()
