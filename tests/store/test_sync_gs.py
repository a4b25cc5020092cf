"""gs:// copies against a local Cloud Storage emulator (PyPI gcp-storage-emulator, the JSON API gcsfs speaks):
verified by GCS's own MD5 of each object without reading it back, a changed object caught, machine loss."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.store import checkpoint as ckpt

gcsfs = pytest.importorskip("gcsfs", reason="gs:// needs gcsfs (pip install 'ftrun[gs]')")
emulator = pytest.importorskip("gcp_storage_emulator.server", reason="the tests need gcp-storage-emulator")


@pytest.fixture
def gcs_server(monkeypatch):
    """An in-memory GCS emulator with one bucket on a free port; .env points gcsfs (and the ftrun processes) at it,
    .requests lists the request lines it answered."""
    requests: list[str] = []
    handler = emulator.RequestHandler
    original = handler.log_request

    def log_request(self, *args, **kwargs):
        requests.append(self.requestline)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(handler, "log_request", log_request)
    monkeypatch.setattr(handler, "log_message", lambda self, *a: None)  # keep the test output readable
    server = emulator.create_server("127.0.0.1", 0, in_memory=True, default_bucket="ftrun-test")
    server.start()
    port = server._api._httpd.server_address[1]
    env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
        # gcsfs's experimental file system first asks the Storage Control API (gRPC) for the bucket's layout;
        # the emulator has none, and each failed lookup costs a credential search
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "FSSPEC_GCS_TOKEN": "anon",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gcsfs.GCSFileSystem.clear_instance_cache()  # a file system made for another test's port is not reused
    yield SimpleNamespace(env=env, requests=requests)
    server.stop()
    gcsfs.GCSFileSystem.clear_instance_cache()


def _checkpoint(root: Path, step: int) -> Path:
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (d / "optimizer.pt").write_bytes(os.urandom(6 << 20))  # past gcsfs's 5 MiB: a resumable upload
    ckpt.write_manifest(d, step, {"recipe_hash": "abc"})
    return d


def _media_reads(lines: list[str]) -> list[str]:
    """Downloads of an object's bytes (alt=media or the /download path), not metadata requests."""
    return [l for l in lines if l.startswith("GET") and ("alt=media" in l or "/download/" in l)]


def test_gs_copy_is_verified_by_the_stores_md5_without_reading_it_back(tmp_path, gcs_server):
    from launcher.store.rundir import RunDir
    from launcher.store.sync import FsspecDestination, push_checkpoint

    step_dir = _checkpoint(tmp_path / "run" / "checkpoints", 10)
    dest = FsspecDestination("gs://ftrun-test/runs/r1")
    assert dest.store == "gs"
    gcs_server.requests.clear()
    assert push_checkpoint(dest, RunDir(tmp_path / "run"), step_dir, keep=2) == 10
    assert _media_reads(gcs_server.requests) == [] and dest.read_back == {"files": 0, "bytes": 0}
    info = dest.fs.info("ftrun-test/runs/r1/checkpoints/step-000010/optimizer.pt")
    import base64
    import hashlib

    assert info["md5Hash"] == base64.b64encode(hashlib.md5((step_dir / "optimizer.pt").read_bytes()).digest()).decode()

    # another writer replaces an object after the upload: its MD5 tells, still without reading it
    data = bytearray((step_dir / "optimizer.pt").read_bytes())
    data[100] ^= 0x01
    dest.fs.pipe_file("ftrun-test/runs/r1/checkpoints/step-000010/optimizer.pt", bytes(data))
    gcs_server.requests.clear()
    manifest = json.loads((step_dir / "manifest.json").read_text())
    ok, why = dest.verify_dir("checkpoints/step-000010", manifest, local=step_dir)
    assert not ok and why == "checkpoints/step-000010/optimizer.pt differs from the manifest off the box"
    assert _media_reads(gcs_server.requests) == []
    dest.fs.rm_file("ftrun-test/runs/r1/checkpoints/step-000010/adapter_model.safetensors")
    ok, why = dest.verify_dir("checkpoints/step-000010", manifest, local=step_dir)
    assert not ok and why == "checkpoints/step-000010/adapter_model.safetensors is missing off the box"


@pytest.mark.slow
def test_gs_machine_loss_resume_on_fresh_box(tmp_path, tiny_model, reference_run, gcs_server):
    from test_sync import _machine_loss_then_resume_elsewhere

    dest = gcsfs.GCSFileSystem()

    def remote_ls(rel: str) -> bool:
        dest.invalidate_cache()
        return dest.exists(f"ftrun-test/runs/r1/{rel}")

    _machine_loss_then_resume_elsewhere(
        tmp_path, tiny_model, reference_run, "gs://ftrun-test/runs/r1", remote_ls, gcs_server.env
    )
