"""Copying a run off the box and back: the newest verified checkpoint, the metadata and the final result go up
(the Syncer thread of the supervisor, with retries); a fresh box pulls them down, each verified."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from launcher.errors import SyncError
from launcher.store import checkpoint as ckpt
from launcher.store.rundir import RunDir
from launcher.store.sync.base import Destination
from launcher.store.sync.hub import HubDestination, tree_files
from launcher.store.sync.kinds import destination

METADATA = ("recipe.yaml", "plan.json", "smoke.json", "metrics.jsonl", "state.json", "worker.json", "train.log")


def _sync_state(run: RunDir) -> dict[str, Any]:
    p = run.root / "sync.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _write_sync_state(run: RunDir, **fields: Any) -> dict[str, Any]:
    data = _sync_state(run)
    data.update(fields)
    ckpt.atomic_write_json(run.root / "sync.json", data)
    return data


def already_copied(dest: Destination, rel: str, local: Path, manifest: dict[str, Any]) -> bool:
    """Whether `rel` off the box already holds `local` as sent (a copier killed before it recorded the end)."""
    if dest.read_bytes_sha256(f"{rel}/{ckpt.MANIFEST}") != ckpt.sha256_file(local / ckpt.MANIFEST):
        return False
    return dest.verify_dir(rel, manifest, local=local)[0]


def push_checkpoint(
    dest: Destination, run: RunDir, step_dir: Path, keep: int, name: Optional[str] = None, maybe_there: bool = False
) -> int:
    """Copy a checkpoint, verify the copy, apply the remote retention (`maybe_there`: check the copy first)."""
    name = name or step_dir.name
    manifest = json.loads((step_dir / ckpt.MANIFEST).read_text())
    rel = f"checkpoints/{name}"
    if not (maybe_there and already_copied(dest, rel, step_dir, manifest)):
        dest.put_dir(step_dir, rel)
        ok, why = dest.verify_dir(rel, manifest, local=step_dir)
        if not ok:
            raise SyncError(f"the copy of {name} at {dest.url} does not verify: {why}")
    # Remote retention: only after the new copy verified, drop the oldest beyond `keep`.
    remote = sorted(n for n in dest.list_dirs("checkpoints") if n.startswith(ckpt.PREFIX))
    dest.remove_dirs([f"checkpoints/{old}" for old in (remote[:-keep] if keep > 0 else []) if old != name])
    return int(manifest["step"])


def metadata_digests(run: RunDir) -> dict[str, str]:
    return {name: ckpt.sha256_file(run.root / name) for name in METADATA if (run.root / name).is_file()}


def push_metadata(dest: Destination, run: RunDir, sent: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The metadata files that differ from `sent` (all when None), together; returns the digests now off the box."""
    now = metadata_digests(run)
    changed = [n for n in now if (sent or {}).get(n) != now[n]]
    dest.put_files([(run.root / n, n) for n in changed], "ftrun: run metadata (" + ", ".join(changed) + ")")
    return {**(sent or {}), **{n: now[n] for n in changed}}


def push_final(dest: Destination, run: RunDir, maybe_there: bool = False) -> None:
    """Each folder of final/ with its manifest, then final/'s files. `maybe_there`: as push_checkpoint's."""
    if not run.final.is_dir():
        return
    for sub in sorted(p for p in run.final.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = tree_files(sub)
        manifest = {
            "files": {
                f.relative_to(sub).as_posix(): {"size": f.stat().st_size, "sha256": ckpt.sha256_file(f)}
                for f in files
                if f.name != ckpt.MANIFEST
            }
        }
        ckpt.atomic_write_json(sub / ckpt.MANIFEST, {"step": -1, **manifest})
        if maybe_there and already_copied(dest, f"final/{sub.name}", sub, manifest):
            continue
        dest.put_dir(sub, f"final/{sub.name}")
        ok, why = dest.verify_dir(f"final/{sub.name}", manifest, local=sub)
        if not ok:
            raise SyncError(f"the copy of final/{sub.name} at {dest.url} does not verify: {why}")
    dest.put_files([(p, f"final/{p.name}") for p in sorted(run.final.iterdir()) if p.is_file()], "ftrun: final/ files")


class Syncer:
    """Background copies from the supervisor: never blocks training, retries with backoff, never raises."""

    def __init__(self, run: RunDir, url: str, keep: int, log=print):
        self.run, self.url, self.keep, self.log = run, url, keep, log
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._dest: Optional[Destination] = None
        self.failures = 0

    def _destination(self) -> Destination:
        if self._dest is None:
            self._dest = destination(self.url)
            if isinstance(self._dest, HubDestination):
                self._dest.on_wait = self._waiting
        return self._dest

    def _waiting(self, wait: Optional[dict[str, Any]]) -> None:
        """A destination waits before retrying (a 429 or 5xx), or is done waiting: `ftrun status` shows it."""
        if wait is None:
            _write_sync_state(self.run, backoff=None)
            return
        retries = _sync_state(self.run).get("retries", 0) + 1
        _write_sync_state(self.run, backoff={**wait, "to": self.url}, retries=retries, to=self.url)
        then = "then tries again" if wait.get("gave_up") else f"then try {wait['attempt']} of {wait['of']}"
        self.log(
            f'sync: {self.url} answered {wait["status"]} to "{wait["what"]}"; waiting {wait["wait_seconds"]:.0f} s '
            f"({wait['source']}), {then}"
        )

    def sync_once(self, final: bool = False) -> bool:
        """Upload what is new; True when everything that exists locally is verified off the box."""
        try:
            state = _sync_state(self.run)
            wait = state.get("backoff")
            if wait and wait.get("gave_up") and wait["until"] > time.time() and wait.get("to", self.url) == self.url:
                return False  # the destination named a time before which it takes nothing (status shows it)
            dest = self._destination()
            newest = next((p for p in ckpt.candidates(self.run.checkpoints) if (p / ckpt.MANIFEST).is_file()), None)
            pushed = False
            if newest is not None and state.get("synced_step") != int(newest.name[len(ckpt.PREFIX) :]):
                t0 = time.monotonic()
                # `sending` names the copy under way: a copier killed before it recorded the end leaves it
                maybe_there = state.get("sending") == {"to": self.url, "what": newest.name}
                _write_sync_state(self.run, sending={"to": self.url, "what": newest.name})
                step = self._push_snapshot(dest, newest, maybe_there)
                _write_sync_state(
                    self.run, synced_step=step, synced_at=time.time(), last_error=None, to=self.url, sending=None
                )
                self.log(f"copied {newest.name} to {self.url} and verified it ({time.monotonic() - t0:.1f} s)")
                pushed = True
            if final:
                maybe_there = _sync_state(self.run).get("sending") == {"to": self.url, "what": "final"}
                _write_sync_state(self.run, sending={"to": self.url, "what": "final"})
                push_final(dest, self.run, maybe_there)
                _write_sync_state(self.run, final_synced_at=time.time(), sending=None)
            background = self._thread is not None and not self._stop.is_set()
            self._push_metadata(dest, throttle=not pushed and not final and background)
            self.failures = 0
            return True
        except (FileNotFoundError, shutil.Error) as exc:  # retention removed it before the snapshot: take the newer one
            self.log(f"sync: a checkpoint vanished before it could be copied ({exc}); taking the newest one")
            return False
        except Exception as exc:  # never let a network problem end the training
            self.failures += 1
            error = f"{type(exc).__name__}: {exc}"[:500]
            _write_sync_state(
                self.run, last_error=error, last_error_at=time.time(), failures=self.failures, to=self.url
            )
            self.log(f"sync to {self.url} failed ({self.failures} in a row): {exc}")
            return False

    def _push_metadata(self, dest: Destination, throttle: bool) -> None:
        """The changed metadata files; with `throttle`, at most every `metadata_every` seconds (Hub commit limits)."""
        state = _sync_state(self.run)
        sent = state.get("metadata_sent") or {}
        sent = (sent.get("sha256") or {}) if sent.get("to") == self.url else {}
        every = getattr(dest, "metadata_every", 0.0)
        if throttle and every and time.time() - (state.get("metadata_at") or 0) < every:
            return
        now = push_metadata(dest, self.run, sent)
        if now != sent:
            _write_sync_state(self.run, metadata_sent={"to": self.url, "sha256": now}, metadata_at=time.time())

    def _push_snapshot(self, dest: Destination, step_dir: Path, maybe_there: bool = False) -> int:
        # a hard-linked snapshot outlives local retention's deletion; one copier at a time, so any other snapshot
        # is a killed copier's leftover, which would pin its checkpoint's disk space
        snap = self.run.checkpoints / f".sync-{step_dir.name}"
        for stale in self.run.checkpoints.glob(".sync-*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            shutil.copytree(step_dir, snap, copy_function=os.link)
            return push_checkpoint(dest, self.run, snap, self.keep, name=step_dir.name, maybe_there=maybe_there)
        finally:
            shutil.rmtree(snap, ignore_errors=True)

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            ok = self.sync_once()
            delay = interval if ok else min(interval * 2**self.failures, 300)
            self._stop.wait(delay)

    def start(self, interval: float = 10.0) -> "Syncer":
        self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True, name="ftrun-sync")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=600)

    def finish(self, final: bool, attempts: int = 4) -> bool:
        """The last copy before the supervisor exits, retried a few times."""
        self.stop()
        for i in range(attempts):
            if self.sync_once(final=final):
                return True
            time.sleep(min(2**i, 15))
        return False


def remote_has_run(url: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        return destination(url).get_file("recipe.yaml", Path(tmp) / "recipe.yaml")


def pull(url: str, run: RunDir, log=print) -> Optional[int]:
    """Fetch the metadata, the newest remote checkpoint that verifies, and any final result; return its step."""
    dest = destination(url)
    run.root.mkdir(parents=True, exist_ok=True)
    for name in METADATA:
        dest.get_file(name, run.root / name)
    if not run.recipe.is_file():
        raise SyncError(f"{url} holds no ftrun run (no recipe.yaml)")
    steps = sorted((n for n in dest.list_dirs("checkpoints") if n.startswith(ckpt.PREFIX)), reverse=True)
    got = None
    for name in steps:
        target = run.checkpoints / name
        tmp = run.checkpoints / f".{name}.pull"
        shutil.rmtree(tmp, ignore_errors=True)
        manifest_path = tmp / ckpt.MANIFEST
        if not dest.get_file(f"checkpoints/{name}/{ckpt.MANIFEST}", manifest_path):
            log(f"pull: skipping {name}: no manifest off the box (an upload that did not finish)")
            continue
        manifest = json.loads(manifest_path.read_text())
        dest.get_dir(f"checkpoints/{name}", tmp, list(manifest["files"]))
        ok, why = ckpt.verify(tmp)
        if not ok:
            log(f"pull: skipping {name}: {why}")
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        got = int(manifest["step"])
        log(f"pull: {name} fetched from {url} and verified")
        break
    for sub in dest.list_dirs("final"):
        local = run.final / sub
        if dest.get_file(f"final/{sub}/{ckpt.MANIFEST}", local / ckpt.MANIFEST):
            manifest = json.loads((local / ckpt.MANIFEST).read_text())
            dest.get_dir(f"final/{sub}", local, list(manifest["files"]))
    _write_sync_state(run, synced_step=got, pulled_from=url, pulled_at=time.time())
    return got


def status_fields(run: RunDir) -> dict[str, Any]:
    s = _sync_state(run)
    if not s:
        return {}
    at = s.get("synced_at")
    return {
        "sync_to": s.get("to") or s.get("pulled_from"),
        "offbox_checkpoint": f"{ckpt.PREFIX}{s['synced_step']:06d}" if s.get("synced_step") is not None else None,
        "offbox_age_seconds": round(time.time() - at, 1) if at else None,
        "sync_error": s.get("last_error"),
        **backoff_fields(s),
    }


def backoff_fields(s: dict[str, Any]) -> dict[str, Any]:
    """The destination's wait before a retry (a 429 or 5xx from the Hub), while it lasts."""
    wait = s.get("backoff")
    left = round(wait["until"] - time.time(), 1) if wait else None
    waiting = wait is not None and left is not None and left > 0
    return {
        # e.g. "429 to \"ftrun: checkpoints/step-000020\": try 2 of 6 in 28 s (Retry-After)"; None when not waiting
        "sync_backoff": (
            f'{wait["status"]} to "{wait["what"]}": '
            + ("next try" if wait.get("gave_up") else f"try {wait['attempt']} of {wait['of']}")
            + f" in {left:.0f} s ({wait['source']})"
        )
        if waiting
        else None,
        "sync_backoff_seconds": left if waiting else None,
        "sync_retries": s.get("retries", 0),  # waits before a retry since the run began
    }
