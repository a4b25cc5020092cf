"""Copies checkpoints and the run's metadata off the box and back, each copy verified against its manifest.

Destinations (recipe `sync.to`):
  user@host:/path, alias:/path   rsync over SSH (options from ~/.ssh/config; RSYNC_RSH is honoured)
  s3://bucket/prefix, gs://..., file:///path, /abs/path   fsspec
  hf://user/repo                 a private Hugging Face model repo (huggingface_hub)
Remote layout mirrors the run directory: checkpoints/step-NNNNNN/ (manifest.json uploaded last),
final/, and the metadata files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from launcher.store import checkpoint as ckpt
from launcher.errors import SyncError
from launcher.store.rundir import RunDir

HUB_TMP_PREFIX = ".hf-get-"  # HubDestination.get_file's download folder beside its target
METADATA = ("recipe.yaml", "plan.json", "smoke.json", "metrics.jsonl", "state.json", "worker.json", "train.log")
_SCP_LIKE = re.compile(r"^(?:[^@/:\s]+@)?[A-Za-z0-9._-]+:(?!//)")


class Destination:
    """One off-box location; paths below it are relative, '/'-separated."""

    url: str

    def put_file(self, local: Path, rel: str) -> None: ...
    def get_file(self, rel: str, local: Path) -> bool: ...
    def list_dirs(self, rel: str) -> list[str]: ...
    def remove_dir(self, rel: str) -> None: ...
    def read_bytes_sha256(self, rel: str) -> Optional[str]: ...

    def put_dir(self, local: Path, rel: str, last: str = ckpt.MANIFEST) -> None:
        """Every file of `local`, the `last` one at the end: its presence marks the copy complete."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            if p.name != last:
                self.put_file(p, f"{rel}/{p.relative_to(local).as_posix()}")
        if (local / last).is_file():
            self.put_file(local / last, f"{rel}/{last}")

    def put_files(self, files: list[tuple[Path, str]], message: str = "") -> None:
        """Several files ((local, rel) pairs) in order; a destination with commits makes them one."""
        for local, rel in files:
            self.put_file(local, rel)

    def remove_dirs(self, rels: list[str]) -> None:
        for rel in rels:
            self.remove_dir(rel)

    def get_dir(self, rel: str, local: Path, files: list[str]) -> None:
        for name in files:
            if not self.get_file(f"{rel}/{name}", local / name):
                raise SyncError(f"{self.url}/{rel}/{name} disappeared while fetching it")

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        """Whether the copy at `rel` holds the manifest's files (`local`: the folder that was sent, where a
        destination can compare without reading the copy back)."""
        for name, info in manifest["files"].items():
            digest = self.read_bytes_sha256(f"{rel}/{name}")
            if digest is None:
                return False, f"{rel}/{name} is missing off the box"
            if digest != info["sha256"]:
                return False, f"{rel}/{name} differs from the manifest off the box"
        return True, ""


# ---------------------------------------------------------------------------------------

class RsyncDestination(Destination):
    """rsync over SSH; every remote operation is an rsync call, so RSYNC_RSH or ~/.ssh/config decide how to connect."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        if shutil.which("rsync") is None:
            raise SyncError("sync.to is an SSH destination but rsync is not installed on this box",
                            fix="apt-get install -y rsync openssh-client (both ends need rsync).")

    def _rsync(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = ["rsync"]
        if "RSYNC_RSH" not in os.environ:
            # Detached runs cannot answer a prompt: fail fast instead of hanging.
            cmd += ["-e", "ssh -o BatchMode=yes -o ConnectTimeout=20"]
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)

    def _remote(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def put_file(self, local: Path, rel: str) -> None:
        # --mkpath (rsync >= 3.2.3) creates the missing folders on the remote side.
        res = self._rsync("-a", "--mkpath", str(local), self._remote(rel))
        if res.returncode != 0:
            raise SyncError(f"rsync to {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")

    def put_dir(self, local: Path, rel: str, last: str = ckpt.MANIFEST) -> None:
        # One rsync for the data (fast, resumable), then the manifest alone.
        res = self._rsync("-a", "--mkpath", "--partial", f"--exclude={last}", f"{local}/", self._remote(rel) + "/")
        if res.returncode != 0:
            raise SyncError(f"rsync to {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")
        if (local / last).is_file():
            self.put_file(local / last, f"{rel}/{last}")

    def get_file(self, rel: str, local: Path) -> bool:
        local.parent.mkdir(parents=True, exist_ok=True)
        res = self._rsync("-a", self._remote(rel), str(local))
        if res.returncode == 23 and ("No such file" in res.stderr or "link_stat" in res.stderr):
            return False
        if res.returncode != 0:
            raise SyncError(f"rsync from {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")
        return True

    def get_dir(self, rel: str, local: Path, files: list[str]) -> None:
        local.mkdir(parents=True, exist_ok=True)
        res = self._rsync("-a", self._remote(rel) + "/", f"{local}/")
        if res.returncode != 0:
            raise SyncError(f"rsync from {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")

    def list_dirs(self, rel: str) -> list[str]:
        res = self._rsync("--list-only", self._remote(rel) + "/")
        if res.returncode != 0:
            if "No such file" in res.stderr or "change_dir" in res.stderr:
                return []
            raise SyncError(f"cannot list {self._remote(rel)}: {res.stderr.strip()[-300:]}")
        names = []
        for line in res.stdout.splitlines():
            parts = line.split(None, 4)
            if len(parts) == 5 and line.startswith("d") and parts[4] not in (".", ".."):
                names.append(parts[4])
        return names

    def remove_dir(self, rel: str) -> None:
        parent, _, name = rel.rpartition("/")
        with tempfile.TemporaryDirectory() as empty:
            # Delete exactly one folder: sync an empty folder with a filter that only sees `name`.
            res = self._rsync("-r", "--delete", f"--include=/{name}/***", "--exclude=*", f"{empty}/",
                              self._remote(parent) + "/")
        if res.returncode != 0:
            raise SyncError(f"cannot remove {self._remote(rel)}: {res.stderr.strip()[-300:]}")

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        if local is None:
            return super().verify_dir(rel, manifest)
        # rsync compares checksums on both ends; any itemized change means the copy differs.
        res = self._rsync("-a", "--checksum", "--dry-run", "--itemize-changes", f"{local}/", self._remote(rel) + "/")
        if res.returncode != 0:
            return False, res.stderr.strip()[-300:]
        changed = [l for l in res.stdout.splitlines() if l and not l.startswith(".d")]
        return (not changed), ("differs off the box: " + "; ".join(changed[:3]) if changed else "")

    def read_bytes_sha256(self, rel: str) -> Optional[str]:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "f"
            if not self.get_file(rel, target):
                return None
            return ckpt.sha256_file(target)


class FsspecDestination(Destination):
    """fsspec: s3:// (s3fs), gs:// (gcsfs), a local or mounted path, any other fsspec URL.

    Each copy is proven by what the store offers, without reading it back (docs/sync.md, "S3 and gs://"):
    S3 gets every object with its SHA-256 (x-amz-checksum-sha256; a multipart upload one per part), checks
    it on receipt, keeps it and returns it to a HEAD; GCS computes each object's MD5 on receipt (md5Hash),
    which gcsfs checks after the upload and a metadata request returns later. A store that returns neither
    (an S3-compatible one without checksums, a local or mounted path) is read back and hashed.
    """

    part_bytes: Optional[int] = None  # multipart upload part size; None: s3_part_bytes

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise SyncError(f"cannot use sync.to={url}: {exc}",
                            fix="install the fsspec backend for this URL (s3fs for s3://, gcsfs for gs://).") from None
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.store = "s3" if "s3" in protocols else "gs" if protocols & {"gs", "gcs"} else "other"
        self._sent: dict[str, SentDigests] = {}  # what put_file sent, by rel, until verify_dir checks it
        self.read_back = {"files": 0, "bytes": 0}  # what verification had to read back (a store without checksums)

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def put_file(self, local: Path, rel: str) -> None:
        target = self._p(rel)
        if self.store == "s3":
            from fsspec.asyn import sync as run_async

            self._sent[rel] = run_async(self.fs.loop, self._s3_put, local, target)
            return
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.store == "gs":
            # gcsfs computes the MD5 of what it sends and compares it with the md5Hash GCS computed of what it
            # received (gcsfs/checkers.py MD5Checker, called at the end of _put_file)
            self.fs.put_file(str(local), target, consistency="md5")
            self._sent[rel] = SentDigests.of_file(local)
        else:
            self.fs.put_file(str(local), target)

    async def _s3_put(self, local: Path, target: str) -> "SentDigests":
        """Upload with SHA-256 checksums, in one PUT or, from twice the part size on (s3fs's own rule,
        S3FileSystem._put_file), as a multipart upload with a checksum per part: s3fs passes no checksum
        with its parts, and S3 can only keep a SHA-256 of a multipart object from its parts' SHA-256s
        (a "composite" checksum, the SHA-256 of the parts' digests, with -N for N parts)."""
        import asyncio

        bucket, key, _ = self.fs.split_path(target)
        size = local.stat().st_size
        part = self.part_bytes or s3_part_bytes(size)
        sent = SentDigests(size)
        with local.open("rb") as fh:
            if size < 2 * part:
                body = fh.read()
                sent.add_part(body)
                # ChecksumAlgorithm names it (x-amz-sdk-checksum-algorithm), ChecksumSHA256 carries our digest:
                # botocore sends a given checksum as is (httpchecksum.resolve_request_checksum_algorithm)
                await self.fs._call_s3("put_object", Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256",
                                       ChecksumSHA256=sent.parts[0][0])
                return sent.done(multipart=False)
            mpu = await self.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256")
            try:
                done: list[dict[str, Any]] = []
                while chunks := [c for c in (fh.read(part) for _ in range(self.fs.max_concurrency)) if c]:
                    first = len(sent.parts)
                    for chunk in chunks:
                        sent.add_part(chunk)
                    outs = await asyncio.gather(*[
                        self.fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                         PartNumber=first + i + 1, Body=chunk, ChecksumAlgorithm="SHA256",
                                         ChecksumSHA256=sent.parts[first + i][0])
                        for i, chunk in enumerate(chunks)])
                    done += [{"PartNumber": first + i + 1, "ETag": o["ETag"], "ChecksumSHA256": sent.parts[first + i][0]}
                             for i, o in enumerate(outs)]
                await self.fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                       MultipartUpload={"Parts": done})
            except BaseException:
                await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"])
                raise
        return sent.done(multipart=True)

    def get_file(self, rel: str, local: Path) -> bool:
        if not self.fs.exists(self._p(rel)):
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._p(rel), str(local))
        return True

    def list_dirs(self, rel: str) -> list[str]:
        self.fs.invalidate_cache()  # object stores cache listings; retention needs the current one
        if not self.fs.exists(self._p(rel)):
            return []
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self._p(rel), detail=True)
                if e.get("type") == "directory"]

    def remove_dir(self, rel: str) -> None:
        if self.fs.exists(self._p(rel)):
            self.fs.rm(self._p(rel), recursive=True)

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        """Each file: the bytes sent hash to the manifest's sha256, and the store's own record of what it holds
        (S3's SHA-256 or ETag, GCS's MD5) is that of the bytes sent; read back only where the store gives none."""
        if local is None or self.store == "other":
            return super().verify_dir(rel, manifest)
        for name, want in manifest["files"].items():
            path = f"{rel}/{name}"
            sent = self._sent.pop(path, None) or SentDigests.of_file(local / name, self.part_bytes, self.store == "s3")
            if sent.sha256 != want["sha256"]:
                return False, f"{path} as sent does not match the manifest (the file changed on this box after its save)"
            held = self._s3_held(path) if self.store == "s3" else self._gs_held(path)
            if held is None:
                return False, f"{path} is missing off the box"
            if held["size"] != want["size"]:
                return False, f"{path} has {held['size']} bytes off the box, manifest says {want['size']}"
            same = sent.matches(held)
            if same is None:  # the store keeps no checksum of it that we can compare: read it back
                digest = self.read_bytes_sha256(path)
                self.read_back["files"] += 1
                self.read_back["bytes"] += held["size"]
                same = digest == want["sha256"]
            if not same:
                return False, f"{path} differs from the manifest off the box"
        return True, ""

    def _s3_held(self, rel: str) -> Optional[dict[str, Any]]:
        """The object's size, SHA-256 checksum and ETag from one HEAD (ChecksumMode=ENABLED asks for the checksum)."""
        from botocore.exceptions import ClientError

        bucket, key, _ = self.fs.split_path(self._p(rel))
        try:
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except FileNotFoundError:  # s3fs's error wrapper turns a 404 into FileNotFoundError
            return None
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return {"size": head["ContentLength"], "sha256": head.get("ChecksumSHA256"),
                "etag": head.get("ETag", "").strip('"'), "kms": head.get("ServerSideEncryption") == "aws:kms"}

    def _gs_held(self, rel: str) -> Optional[dict[str, Any]]:
        self.fs.invalidate_cache(self._p(rel))
        try:
            info = self.fs.info(self._p(rel))
        except FileNotFoundError:
            return None
        return {"size": int(info["size"]), "md5": info.get("md5Hash")}

    def read_bytes_sha256(self, rel: str) -> Optional[str]:
        if not self.fs.exists(self._p(rel)):
            return None
        h = hashlib.sha256()
        with self.fs.open(self._p(rel), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()


def s3_part_bytes(size: int) -> int:
    """The part size of a multipart upload: s3fs's rule (s3fs.core.calculate_chunksize): 50 MiB, larger where a
    file would need more than S3's 10,000 parts."""
    return max(50 << 20, -(-size // 10_000))


class SentDigests:
    """The digests of a file as uploaded: its sha256 (for the manifest), and what the store will report of it
    if it holds those bytes: S3's SHA-256 checksum (whole file, or composite of the parts: base64 of the
    SHA-256 of the parts' digests, '-N') and ETag (MD5, or the MD5 of the parts' MD5s, '-N'), GCS's md5Hash."""

    def __init__(self, size: int):
        self.size = size
        self.parts: list[tuple[str, bytes]] = []  # (base64 SHA-256, raw MD5) of each part
        self._sha256, self._md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
        self.sha256 = self.s3_checksum = self.etag = self.gs_md5 = ""

    def add_part(self, data: bytes) -> None:
        self._sha256.update(data)
        self._md5.update(data)
        self.parts.append((base64.b64encode(hashlib.sha256(data).digest()).decode(),
                           hashlib.md5(data, usedforsecurity=False).digest()))

    def done(self, multipart: bool) -> "SentDigests":
        self.sha256 = self._sha256.hexdigest()
        self.gs_md5 = base64.b64encode(self._md5.digest()).decode()
        if multipart:
            n = len(self.parts)
            self.s3_checksum = base64.b64encode(hashlib.sha256(
                b"".join(base64.b64decode(p) for p, _ in self.parts)).digest()).decode() + f"-{n}"
            self.etag = hashlib.md5(b"".join(m for _, m in self.parts), usedforsecurity=False).hexdigest() + f"-{n}"
        else:
            self.s3_checksum = self.parts[0][0] if self.parts else base64.b64encode(hashlib.sha256().digest()).decode()
            self.etag = self._md5.hexdigest()
        return self

    @classmethod
    def of_file(cls, path: Path, part_bytes: Optional[int] = None, s3: bool = False) -> "SentDigests":
        """The same digests computed from the local file (a file sent by an earlier process), read in the parts
        an S3 upload of it uses."""
        size = path.stat().st_size
        part = (part_bytes or s3_part_bytes(size)) if s3 else 0
        multipart = s3 and size >= 2 * part
        sent = cls(size)
        with path.open("rb") as fh:
            if not multipart:
                whole_sha, whole_md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
                for chunk in iter(lambda: fh.read(8 << 20), b""):
                    whole_sha.update(chunk)
                    whole_md5.update(chunk)
                sent._sha256, sent._md5 = whole_sha, whole_md5
                sent.parts = [(base64.b64encode(whole_sha.digest()).decode(), whole_md5.digest())]
            else:
                for chunk in iter(lambda: fh.read(part), b""):
                    sent.add_part(chunk)
        return sent.done(multipart)

    def matches(self, held: dict[str, Any]) -> Optional[bool]:
        """Whether the store holds these bytes, by its own checksum; None when it reports none we can compare."""
        if held.get("sha256"):  # S3 computed it on receipt (and checked ours): decisive either way
            # a multipart object's comes with "-N" (N parts) from S3, without it from some S3-compatible stores;
            # base64 has no "-", and a composite checksum never equals a whole-file one by accident
            return held["sha256"].split("-")[0] == self.s3_checksum.split("-")[0]
        if held.get("md5"):  # GCS's md5Hash of the object
            return held["md5"] == self.gs_md5
        if held.get("etag") and not held.get("kms") and held["etag"] == self.etag:
            # without SSE-KMS an ETag is the MD5 (of the parts' MD5s); one that differs may be another kind of ETag
            return True
        return None


class HubDestination(Destination):
    """A private Hugging Face repo, changed only through commits (HfApi.create_commit), each all or nothing.

    A checkpoint is one commit holding all its files, the manifest with them; retention deletes old
    checkpoints in one commit and then squashes the branch's history (HfApi.super_squash_history), since
    the large files of a deleted folder stay in the history, and count against the storage, until no
    commit references them. The token is huggingface_hub's own (`HF_TOKEN`, else the one `hf auth login`
    stored): HfApi reads it through huggingface_hub.get_token at each request.

    The Hub limits requests and commits per hour: a 429 (and a 408 or 5xx) is retried here after the time
    the Hub asks for (Retry-After, or the RateLimit header's reset), else with an exponential backoff;
    `on_wait` hears about each wait (the Syncer records it for `ftrun status`)."""

    RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
    ATTEMPTS = 6  # then the error goes to the Syncer, which tries again on its own, slower cadence
    # The longest wait spent here, in seconds (the API's rate limit windows are 5 minutes: a reset within a
    # minute is common). A longer one (the commit limit, per hour) goes to the Syncer with the time the Hub
    # named: it sends nothing before then, and the supervisor is never held for it (Syncer.stop joins).
    MAX_WAIT = 60.0
    metadata_every = 300.0  # seconds between metadata commits while training (commits are rate limited)
    sleep = staticmethod(time.sleep)

    def __init__(self, url: str, on_wait=None):
        from huggingface_hub import HfApi, get_token

        self.url = url.rstrip("/")
        parts = self.url[len("hf://"):].split("/", 2)
        if len(parts) < 2 or not all(parts[:2]):
            raise SyncError(f"sync.to={url} does not name a repo", fix="write hf://USER/REPO[/subfolder].")
        self.repo = f"{parts[0]}/{parts[1]}"
        self.prefix = parts[2] if len(parts) == 3 else ""
        if not get_token():
            raise SyncError(f"sync.to={url} is a Hugging Face repo, but no Hugging Face token is set on this box",
                            fix="run `hf auth login` (it stores the token where huggingface_hub finds it), or set "
                            "HF_TOKEN to a token with write access; never put it in the recipe.")
        self.on_wait = on_wait
        self.api = HfApi()
        from huggingface_hub.errors import HfHubHTTPError

        try:
            self._retrying(f"create {self.repo}", lambda: self.api.create_repo(self.repo, private=True, exist_ok=True))
        except HfHubHTTPError as exc:
            raise SyncError(f"the Hub refused to open or create the private repo {self.repo} "
                            f"({exc.response.status_code}): {str(exc).strip().splitlines()[0][:300]}",
                            fix="check that the token can write to that namespace (`hf auth whoami`; a "
                            "fine-grained token needs write access to it).") from None
        except Exception as exc:  # noqa: BLE001 - the network below huggingface_hub (httpx) has its own errors
            raise SyncError(f"cannot reach the Hub for {self.url}: {type(exc).__name__}: {exc}",
                            fix="check the network (and HF_ENDPOINT if set), then run the same command again.") from None

    def _p(self, rel: str) -> str:
        return f"{self.prefix}/{rel}".strip("/") if self.prefix else rel

    # -- every request through one retry policy -------------------------------------------

    def _retrying(self, what: str, call, landed=None):
        """`call()`, again after a 429/408/5xx; `landed()` (for commits) says whether a commit whose answer was
        lost to a 5xx is on the Hub after all, so that a retry never makes it twice."""
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
                self._tell({"status": status, "what": what, "attempt": attempt + 1, "of": self.ATTEMPTS,
                            "wait_seconds": delay, "source": source, "until": time.time() + delay,
                            "gave_up": gave_up,  # the Syncer sends nothing before `until`
                            "message": str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""})
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
        # The same operation objects across retries: huggingface_hub skips what it already uploaded
        # (`_is_uploaded`, hf_api.preupload_lfs_files) and refuses only objects already committed.
        self._retrying(message, lambda: self.api.create_commit(self.repo, operations, commit_message=message),
                       landed=landed)

    # -- Destination ------------------------------------------------------------------------

    def put_files(self, files: list[tuple[Path, str]], message: str = "") -> None:
        """All `files` ((local, rel) pairs) in one commit."""
        from huggingface_hub import CommitOperationAdd

        if not files:
            return
        ops = [CommitOperationAdd(path_in_repo=self._p(rel), path_or_fileobj=str(local)) for local, rel in files]
        self._commit(ops, message or f"ftrun: {', '.join(rel for _, rel in files[:3])}"
                     + (f" and {len(files) - 3} more" if len(files) > 3 else ""),
                     landed=lambda: self._holds(ops, [local for local, _ in files]))

    def put_file(self, local: Path, rel: str) -> None:
        self.put_files([(local, rel)])

    def put_dir(self, local: Path, rel: str, last: str = ckpt.MANIFEST) -> None:
        # One commit with every file, the manifest among them: on the Hub the folder is complete or absent.
        files = sorted(p for p in local.rglob("*") if p.is_file()
                       and not any(part.startswith(HUB_TMP_PREFIX) for part in p.relative_to(local).parts))
        self.put_files([(p, f"{rel}/{p.relative_to(local).as_posix()}") for p in files], f"ftrun: {rel}")

    def _holds(self, ops: list, sent: list[Path]) -> bool:
        """Whether the branch holds these additions as sent: an LFS file under the sha256 huggingface_hub
        computed of it (read only now, after a lost answer), a small one under the git blob id of the file."""
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
            infos.update({i.path: i for i in self._retrying(
                "read the file list", lambda: self.api.get_paths_info(self.repo, batch))})
        return infos

    def get_file(self, rel: str, local: Path) -> bool:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RemoteEntryNotFoundError

        # Straight into a folder beside the target, not through the Hub cache (HF_HUB_CACHE): a
        # checkpoint fetched through the cache would sit on the box's disk twice.
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=HUB_TMP_PREFIX, dir=local.parent))
        try:
            try:
                path = self._retrying(f"download {rel}", lambda: self._download(rel, tmp))
            except RemoteEntryNotFoundError:  # the Hub answered: not there
                return False
            except LocalEntryNotFoundError as exc:  # the Hub did not answer: "missing" would start the run afresh
                raise SyncError(f"cannot reach the Hub for {self.url}/{rel}: {exc}",
                                fix="check the network and the token (`hf auth whoami`), then run the same "
                                "command again.") from None
            except HfHubHTTPError as exc:  # still refused after the retries: not "missing" either
                raise SyncError(f"the Hub refused {self.url}/{rel}: {str(exc).strip().splitlines()[0][:300]}",
                                fix="check the token's access to the repo (`hf auth whoami`); after a 429, wait "
                                "and run the same command again.") from None
            os.replace(path, local)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _download(self, rel: str, folder: Path) -> str:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return self.api.hf_hub_download(self.repo, self._p(rel), local_dir=str(folder))
        except LocalEntryNotFoundError as exc:
            # hf_hub_download reports a Hub that answered 429 or 5xx as "not found locally" (file_download.py,
            # _raise_on_head_call_error): the answer itself decides whether to wait and retry
            if isinstance(exc.__cause__, HfHubHTTPError):
                raise exc.__cause__ from None
            raise

    def list_dirs(self, rel: str) -> list[str]:
        from huggingface_hub.errors import RemoteEntryNotFoundError

        try:  # a generator: a missing folder raises while iterating, not at the call
            entries = self._retrying(f"list {rel or '/'}", lambda: list(
                self.api.list_repo_tree(self.repo, path_in_repo=self._p(rel) or None)))
        except RemoteEntryNotFoundError:
            return []
        return [e.path.rsplit("/", 1)[-1] for e in entries if e.__class__.__name__ == "RepoFolder"]

    def remove_dir(self, rel: str) -> None:
        self.remove_dirs([rel])

    def remove_dirs(self, rels: list[str]) -> None:
        """One commit deleting the folders, then the history squashed so their large files are freed.

        Deleting a folder only removes its pointers from the newest commit; the LFS/Xet objects stay
        referenced by the history and keep counting against the repo's storage. Squashing the branch into one
        commit leaves them unreferenced, and the Hub frees unreferenced objects. The price: the branch's
        earlier commits are gone (every folder's, not only these). The alternative,
        HfApi.permanently_delete_lfs_files, keeps the history but deletes objects by hash, and a newer
        checkpoint with an identical file (a frozen part, a tokenizer) shares that object."""
        from huggingface_hub import CommitOperationDelete

        if not rels:
            return
        ops = [CommitOperationDelete(path_in_repo=self._p(rel).rstrip("/") + "/", is_folder=True) for rel in rels]
        names = ", ".join(r.rsplit("/", 1)[-1] for r in rels)
        self._commit(ops, f"ftrun: retention removes {names}",
                     landed=lambda: not set(self._p(r) for r in rels) & set(self._paths_info([self._p(r) for r in rels])))
        self._retrying("squash the history", lambda: self.api.super_squash_history(
            self.repo, commit_message=f"ftrun: history squashed after removing {names}"))

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        """From what the Hub lists, without downloading the copy: every file there with the manifest's size;
        a large (LFS/Xet) file listed under the manifest's sha256 (the LFS oid, which huggingface_hub computes
        from the file it sends and under which the Hub stores the object); a small file with the git blob id
        the Hub computed of what it received, against the id of the sent file, which must itself match the
        manifest."""
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

    def read_bytes_sha256(self, rel: str) -> Optional[str]:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "f"
            return ckpt.sha256_file(target) if self.get_file(rel, target) else None


def hub_retry_delay(headers, attempt: int) -> tuple[float, str]:
    """Seconds to wait before the next try, and why: the Hub's Retry-After (seconds or an HTTP date), else its
    RateLimit header's reset when the window is spent (huggingface_hub.utils.parse_ratelimit_headers), else
    2, 4, 8 ... seconds (at most 5 minutes)."""
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
    return min(2.0 ** attempt, 300.0), "backoff"


def git_blob_id(path: Path) -> str:
    """The git object id of a file's content (what the Hub reports as a small file's blob id)."""
    return ckpt.hash_file(path, hashlib.sha1(f"blob {path.stat().st_size}\0".encode()))


def destination(url: str) -> Destination:
    if url.startswith("hf://"):
        return HubDestination(url)
    if "://" in url or url.startswith("/"):
        return FsspecDestination(url)
    if _SCP_LIKE.match(url):
        return RsyncDestination(url)
    raise SyncError(f"sync.to={url!r} is not a destination ftrun knows",
                    fix="use user@host:/path or an SSH alias alias:/path (rsync), s3://bucket/prefix, gs://..., "
                    "file:///path or an absolute path (fsspec), or hf://user/repo.")


# ---------------------------------------------------------------------------------------
# Upload: the newest verified checkpoint, the metadata, the final result.

def _sync_state(run: RunDir) -> dict[str, Any]:
    p = run.root / "sync.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _write_sync_state(run: RunDir, **fields: Any) -> dict[str, Any]:
    data = _sync_state(run)
    data.update(fields)
    ckpt.atomic_write_json(run.root / "sync.json", data)
    return data


def push_checkpoint(dest: Destination, run: RunDir, step_dir: Path, keep: int, name: Optional[str] = None) -> int:
    name = name or step_dir.name
    manifest = json.loads((step_dir / ckpt.MANIFEST).read_text())
    rel = f"checkpoints/{name}"
    dest.put_dir(step_dir, rel)
    ok, why = dest.verify_dir(rel, manifest, local=step_dir)
    if not ok:
        raise SyncError(f"the copy of {name} at {dest.url} does not verify: {why}")
    # Remote retention: only after the new copy verified, drop the oldest beyond `keep`.
    remote = sorted(n for n in dest.list_dirs("checkpoints") if n.startswith(ckpt.PREFIX))
    dest.remove_dirs([f"checkpoints/{old}" for old in (remote[:-keep] if keep > 0 else []) if old != name])
    return int(manifest["step"])


def metadata_digests(run: RunDir) -> dict[str, str]:
    """{name: sha256} of the run's metadata files present now."""
    return {name: ckpt.sha256_file(run.root / name) for name in METADATA if (run.root / name).is_file()}


def push_metadata(dest: Destination, run: RunDir, sent: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The metadata files that differ from `sent` (all when None), together (one commit on the Hub);
    returns the digests now off the box."""
    now = metadata_digests(run)
    changed = [n for n in now if (sent or {}).get(n) != now[n]]
    dest.put_files([(run.root / n, n) for n in changed], "ftrun: run metadata (" + ", ".join(changed) + ")")
    return {**(sent or {}), **{n: now[n] for n in changed}}


def push_final(dest: Destination, run: RunDir) -> None:
    if not run.final.is_dir():
        return
    for sub in sorted(p for p in run.final.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(p for p in sub.rglob("*") if p.is_file()
                       and not any(part.startswith(HUB_TMP_PREFIX) for part in p.relative_to(sub).parts))
        manifest = {"files": {f.relative_to(sub).as_posix(): {"size": f.stat().st_size, "sha256": ckpt.sha256_file(f)}
                              for f in files if f.name != ckpt.MANIFEST}}
        ckpt.atomic_write_json(sub / ckpt.MANIFEST, {"step": -1, **manifest})
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
        self.log(f"sync: {self.url} answered {wait['status']} to \"{wait['what']}\"; waiting {wait['wait_seconds']:.0f} s "
                 f"({wait['source']}), {then}")

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
            if newest is not None and state.get("synced_step") != int(newest.name[len(ckpt.PREFIX):]):
                t0 = time.monotonic()
                step = self._push_snapshot(dest, newest)
                _write_sync_state(self.run, synced_step=step, synced_at=time.time(), last_error=None, to=self.url)
                self.log(f"copied {newest.name} to {self.url} and verified it ({time.monotonic() - t0:.1f} s)")
                pushed = True
            if final:
                push_final(dest, self.run)
                _write_sync_state(self.run, final_synced_at=time.time())
            self._push_metadata(dest, throttle=not pushed and not final and self._thread is not None
                                and not self._stop.is_set())
            self.failures = 0
            return True
        except (FileNotFoundError, shutil.Error) as exc:  # retention removed it before the snapshot: take the newer one
            self.log(f"sync: a checkpoint vanished before it could be copied ({exc}); taking the newest one")
            return False
        except Exception as exc:  # never let a network problem end the training
            self.failures += 1
            _write_sync_state(self.run, last_error=f"{type(exc).__name__}: {exc}"[:500], last_error_at=time.time(),
                              failures=self.failures, to=self.url)
            self.log(f"sync to {self.url} failed ({self.failures} in a row): {exc}")
            return False

    def _push_metadata(self, dest: Destination, throttle: bool) -> None:
        """The metadata files that changed since they last went off the box, together. While training, a
        destination whose writes are rate limited (the Hub's commits) gets them at most every
        `metadata_every` seconds, and always with a new checkpoint and at the end."""
        state = _sync_state(self.run)
        sent = state.get("metadata_sent") or {}
        sent = (sent.get("sha256") or {}) if sent.get("to") == self.url else {}
        every = getattr(dest, "metadata_every", 0.0)
        if throttle and every and time.time() - (state.get("metadata_at") or 0) < every:
            return
        now = push_metadata(dest, self.run, sent)
        if now != sent:
            _write_sync_state(self.run, metadata_sent={"to": self.url, "sha256": now}, metadata_at=time.time())

    def _push_snapshot(self, dest: Destination, step_dir: Path) -> int:
        # Local retention may delete this checkpoint while it uploads (a new one arrived): copy
        # from a hard-linked snapshot, which costs no space and outlives the deletion.
        snap = self.run.checkpoints / f".sync-{step_dir.name}"
        # A snapshot left by a copier killed mid-upload would pin its checkpoint's disk space (hard links) once
        # retention deletes the checkpoint: one copier at a time, so any snapshot here is such a leftover.
        for stale in self.run.checkpoints.glob(".sync-*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            shutil.copytree(step_dir, snap, copy_function=os.link)
            return push_checkpoint(dest, self.run, snap, self.keep, name=step_dir.name)
        finally:
            shutil.rmtree(snap, ignore_errors=True)

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            ok = self.sync_once()
            delay = interval if ok else min(interval * 2 ** self.failures, 300)
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
            time.sleep(min(2 ** i, 15))
        return False


# ---------------------------------------------------------------------------------------
# Download: a fresh box gets the run back.

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
        "sync_backoff": (f"{wait['status']} to \"{wait['what']}\": "
                         + ("next try" if wait.get("gave_up") else f"try {wait['attempt']} of {wait['of']}")
                         + f" in {left:.0f} s ({wait['source']})") if waiting else None,
        "sync_backoff_seconds": left if waiting else None,
        "sync_retries": s.get("retries", 0),  # waits before a retry since the run began
    }
