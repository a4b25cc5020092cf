"""Copies to a private Hugging Face repo (sync.to: hf://user/repo), each through one commit."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from launcher.errors import SyncError
from launcher.store import checkpoint as ckpt
from launcher.store.sync.base import Destination

HUB_TMP_PREFIX = ".hf-get-"  # HubDestination.get_file's download folder beside its target


class HubDestination(Destination):
    """A private Hugging Face repo, changed only through commits, each all or nothing (docs/sync.md, "Hugging Face
    Hub"). A 429, 408 or 5xx is retried here (hub_retry_delay); `on_wait` hears of each wait."""

    RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
    ATTEMPTS = 6  # then the error goes to the Syncer, which tries again on its own, slower cadence
    # The longest wait spent here, in seconds; a longer one (the hourly commit limit) goes to the Syncer with the time
    # the Hub named, so the supervisor is never held for it.
    MAX_WAIT = 60.0
    metadata_every = 300.0  # seconds between metadata commits while training (commits are rate limited)
    sleep = staticmethod(time.sleep)

    def __init__(self, url: str, on_wait=None):
        from huggingface_hub import HfApi, get_token

        self.url = url.rstrip("/")
        parts = self.url[len("hf://") :].split("/", 2)
        if len(parts) < 2 or not all(parts[:2]):
            raise SyncError(f"sync.to={url} does not name a repo", fix="write hf://USER/REPO[/subfolder].")
        self.repo = f"{parts[0]}/{parts[1]}"
        self.prefix = parts[2] if len(parts) == 3 else ""
        if not get_token():
            raise SyncError(
                f"sync.to={url} is a Hugging Face repo, but no Hugging Face token is set on this box",
                fix="run `hf auth login` (it stores the token where huggingface_hub finds it), or set "
                "HF_TOKEN to a token with write access; never put it in the recipe.",
            )
        self.on_wait = on_wait
        self.api = HfApi()
        from huggingface_hub.errors import HfHubHTTPError

        try:
            self._retrying(f"create {self.repo}", lambda: self.api.create_repo(self.repo, private=True, exist_ok=True))
        except HfHubHTTPError as exc:
            raise SyncError(
                f"the Hub refused to open or create the private repo {self.repo} "
                f"({exc.response.status_code}): {str(exc).strip().splitlines()[0][:300]}",
                fix="check that the token can write to that namespace (`hf auth whoami`; a "
                "fine-grained token needs write access to it).",
            ) from None
        except Exception as exc:  # noqa: BLE001 - the network below huggingface_hub (httpx) has its own errors
            raise SyncError(
                f"cannot reach the Hub for {self.url}: {type(exc).__name__}: {exc}",
                fix="check the network (and HF_ENDPOINT if set), then run the same command again.",
            ) from None

    def _p(self, rel: str) -> str:
        return f"{self.prefix}/{rel}".strip("/") if self.prefix else rel

    def _retrying(self, what: str, call, landed=None):
        """`call()`, again after a 429/408/5xx; `landed()` says whether a commit whose answer was lost to a 5xx is on
        the Hub after all, so that a retry never makes it twice."""
        from huggingface_hub.errors import HfHubHTTPError

        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                result = call()
            except HfHubHTTPError as exc:
                status = getattr(exc.response, "status_code", None)
                if status not in self.RETRY_STATUSES:
                    if attempt > 1:
                        self._tell(None)  # no longer waiting: the error goes up, to the Syncer
                    raise
                delay, source = hub_retry_delay(exc.response.headers, attempt)
                gave_up = attempt == self.ATTEMPTS or delay > self.MAX_WAIT
                self._tell(
                    {
                        "status": status,
                        "what": what,
                        "attempt": attempt + 1,
                        "of": self.ATTEMPTS,
                        "wait_seconds": delay,
                        "source": source,
                        "until": time.time() + delay,
                        "gave_up": gave_up,  # the Syncer sends nothing before `until`
                        "message": str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
                    }
                )
                if gave_up:
                    raise
                self.sleep(delay)
                if status >= 500 and landed is not None and landed():
                    self._tell(None)
                    return None
                continue
            if attempt > 1:
                self._tell(None)
            return result
        raise AssertionError("unreachable")

    def _tell(self, wait: Optional[dict[str, Any]]) -> None:
        if self.on_wait is not None:
            self.on_wait(wait)

    def _commit(self, operations: list, message: str, landed=None) -> None:
        # the same operation objects across retries: huggingface_hub skips what it already uploaded (`_is_uploaded`)
        self._retrying(
            message, lambda: self.api.create_commit(self.repo, operations, commit_message=message), landed=landed
        )

    def put_files(self, files: list[tuple[Path, str]], message: str = "") -> None:
        """All `files` ((local, rel) pairs) in one commit."""
        from huggingface_hub import CommitOperationAdd

        if not files:
            return
        ops = [CommitOperationAdd(path_in_repo=self._p(rel), path_or_fileobj=str(local)) for local, rel in files]
        self._commit(
            ops,
            message
            or f"ftrun: {', '.join(rel for _, rel in files[:3])}"
            + (f" and {len(files) - 3} more" if len(files) > 3 else ""),
            landed=lambda: self._holds(ops, [local for local, _ in files]),
        )

    def put_file(self, local: Path, rel: str) -> None:
        self.put_files([(local, rel)])

    def put_dir(self, local: Path, rel: str, last: str = ckpt.MANIFEST) -> None:
        # One commit with every file, the manifest among them: on the Hub the folder is complete or absent.
        files = [(p, f"{rel}/{p.relative_to(local).as_posix()}") for p in tree_files(local)]
        self.put_files(files, f"ftrun: {rel}")

    def _holds(self, ops: list, sent: list[Path]) -> bool:
        """Whether the branch holds these additions as sent (LFS sha256, or git blob id)."""
        infos = self._paths_info([op.path_in_repo for op in ops])
        for op, local in zip(ops, sent):
            info = infos.get(op.path_in_repo)
            if info is None or not hasattr(info, "blob_id") or info.size != op.upload_info.size:
                return False
            if info.lfs is not None and info.lfs.sha256 != op.upload_info.sha256.hex():
                return False
            if info.lfs is None and info.blob_id != git_blob_id(local):
                return False
        return True

    def _paths_info(self, paths: list[str]) -> dict[str, Any]:
        from huggingface_hub.utils import chunk_iterable

        infos: dict[str, Any] = {}
        for chunk in chunk_iterable(paths, 500):  # the Hub takes 1,000 paths per call at most
            batch = list(chunk)
            found = self._retrying("read the file list", lambda: self.api.get_paths_info(self.repo, batch))
            infos.update({i.path: i for i in found})
        return infos

    def get_file(self, rel: str, local: Path) -> bool:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RemoteEntryNotFoundError

        # straight into a folder beside the target, not through the Hub cache (it would sit on the disk twice)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=HUB_TMP_PREFIX, dir=local.parent))
        try:
            try:
                path = self._retrying(f"download {rel}", lambda: self._download(rel, tmp))
            except RemoteEntryNotFoundError:  # the Hub answered: not there
                return False
            except LocalEntryNotFoundError as exc:  # the Hub did not answer: "missing" would start the run afresh
                raise SyncError(
                    f"cannot reach the Hub for {self.url}/{rel}: {exc}",
                    fix="check the network and the token (`hf auth whoami`), then run the same command again.",
                ) from None
            except HfHubHTTPError as exc:  # still refused after the retries: not "missing" either
                raise SyncError(
                    f"the Hub refused {self.url}/{rel}: {str(exc).strip().splitlines()[0][:300]}",
                    fix="check the token's access to the repo (`hf auth whoami`); after a 429, wait "
                    "and run the same command again.",
                ) from None
            os.replace(path, local)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _download(self, rel: str, folder: Path) -> str:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return self.api.hf_hub_download(self.repo, self._p(rel), local_dir=str(folder))
        except LocalEntryNotFoundError as exc:
            # a 429 or 5xx comes as "not found locally" (file_download.py _raise_on_head_call_error): retried as such
            if isinstance(exc.__cause__, HfHubHTTPError):
                raise exc.__cause__ from None
            raise

    def list_dirs(self, rel: str) -> list[str]:
        from huggingface_hub.errors import RemoteEntryNotFoundError

        try:  # a generator: a missing folder raises while iterating, not at the call
            folder = self._p(rel) or None
            entries = self._retrying(
                f"list {rel or '/'}", lambda: list(self.api.list_repo_tree(self.repo, path_in_repo=folder))
            )
        except RemoteEntryNotFoundError:
            return []
        return [e.path.rsplit("/", 1)[-1] for e in entries if e.__class__.__name__ == "RepoFolder"]

    def remove_dir(self, rel: str) -> None:
        self.remove_dirs([rel])

    def remove_dirs(self, rels: list[str]) -> None:
        """One commit deleting the folders, then the history squashed so their large files are freed (why squash,
        not permanently_delete_lfs_files: docs/sync.md, "Retention frees storage")."""
        from huggingface_hub import CommitOperationDelete

        if not rels:
            return
        ops = [CommitOperationDelete(path_in_repo=self._p(rel).rstrip("/") + "/", is_folder=True) for rel in rels]
        names = ", ".join(r.rsplit("/", 1)[-1] for r in rels)
        paths = [self._p(r) for r in rels]
        self._commit(
            ops, f"ftrun: retention removes {names}", landed=lambda: not set(paths) & set(self._paths_info(paths))
        )
        squashed = f"ftrun: history squashed after removing {names}"
        self._retrying("squash the history", lambda: self.api.super_squash_history(self.repo, commit_message=squashed))

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        """From what the Hub lists, without downloading: each file's size; a large file's LFS oid against the manifest's
        sha256, a small one's git blob id against the sent file's (else downloaded and hashed)."""
        names = list(manifest["files"])
        infos = self._paths_info([self._p(f"{rel}/{n}") for n in names])
        for name in names:
            want, info = manifest["files"][name], infos.get(self._p(f"{rel}/{name}"))
            if info is None or not hasattr(info, "blob_id"):
                return False, f"{rel}/{name} is missing off the box"
            if info.size != want["size"]:
                return False, f"{rel}/{name} has {info.size} bytes off the box, manifest says {want['size']}"
            if info.lfs is not None:
                same = info.lfs.sha256 == want["sha256"]
            elif local is not None:
                same = info.blob_id == git_blob_id(local / name) and ckpt.sha256_file(local / name) == want["sha256"]
            else:
                same = self.read_bytes_sha256(f"{rel}/{name}") == want["sha256"]
            if not same:
                return False, f"{rel}/{name} differs from the manifest off the box"
        return True, ""


def hub_retry_delay(headers, attempt: int) -> tuple[float, str]:
    """Seconds to wait before the next try, and why: Retry-After, else the spent RateLimit window's reset
    (parse_ratelimit_headers), else 2, 4, 8 ... seconds (at most 5 minutes)."""
    from email.utils import parsedate_to_datetime

    from huggingface_hub.utils import parse_ratelimit_headers

    value = next((v for k, v in (headers or {}).items() if k.lower() == "retry-after"), None)
    if value is not None:
        value = value.strip()
        try:
            return max(float(value), 0.0), "Retry-After"
        except ValueError:
            try:
                return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0), "Retry-After"
            except (TypeError, ValueError):
                pass
    info = parse_ratelimit_headers(headers or {})
    if info is not None and info.remaining == 0:
        return float(info.reset_in_seconds), "RateLimit"
    return min(2.0**attempt, 300.0), "backoff"


def tree_files(folder: Path) -> list[Path]:
    """The files below `folder`, sorted, without get_file's download folders."""
    files = (p for p in folder.rglob("*") if p.is_file())
    return sorted(p for p in files if not any(s.startswith(HUB_TMP_PREFIX) for s in p.relative_to(folder).parts))


def git_blob_id(path: Path) -> str:
    """The git object id of a file's content (what the Hub reports as a small file's blob id)."""
    return ckpt.hash_file(path, hashlib.sha1(f"blob {path.stat().st_size}\0".encode()))
