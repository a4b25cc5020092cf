"""Copies through fsspec (sync.to: kinds.py FSSPEC_PROTOCOLS): object stores prove each copy by their own
checksums, other stores are read back."""

from __future__ import annotations

import base64
import functools
import hashlib
from pathlib import Path
from typing import Any, Optional

from launcher.errors import SyncError
from launcher.store.sync.base import Destination


class FsspecDestination(Destination):
    """fsspec: s3:// (s3fs), gs:// (gcsfs), a local or mounted path, any other fsspec URL. Each copy is proven by
    the store's own checksum (S3's SHA-256, GCS's MD5: docs/sync.md, "S3 and gs://"), else read back and hashed."""

    part_bytes: Optional[int] = None  # multipart upload part size; None: s3_part_bytes

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise SyncError(
                f"cannot use sync.to={url}: {exc}",
                fix="install the fsspec backend for this URL (s3fs for s3://, gcsfs for gs://).",
            ) from None
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
            # gcsfs checks the MD5 it sent against GCS's md5Hash (gcsfs/checkers.py MD5Checker, in _put_file)
            self.fs.put_file(str(local), target, consistency="md5")
            self._sent[rel] = SentDigests.of_file(local)
        else:
            self.fs.put_file(str(local), target)

    async def _s3_put(self, local: Path, target: str) -> "SentDigests":
        """Upload with SHA-256 checksums: one PUT, or from twice the part size on (S3FileSystem._put_file) a
        multipart upload with a checksum per part (s3fs sends none, and S3 composes a multipart SHA-256 from them)."""
        import asyncio

        bucket, key, _ = self.fs.split_path(target)
        size = local.stat().st_size
        part = self.part_bytes or s3_part_bytes(size)
        sent = SentDigests(size)
        s3 = functools.partial(self.fs._call_s3, Bucket=bucket, Key=key)
        summed = functools.partial(s3, ChecksumAlgorithm="SHA256")
        with local.open("rb") as fh:
            if size < 2 * part:
                body = fh.read()
                sent.add_part(body)
                # botocore sends a given checksum as is (httpchecksum.resolve_request_checksum_algorithm)
                await summed("put_object", Body=body, ChecksumSHA256=sent.parts[0][0])
                return sent.done(multipart=False)
            upload = (await summed("create_multipart_upload"))["UploadId"]
            try:
                done: list[dict[str, Any]] = []
                while chunks := [c for c in (fh.read(part) for _ in range(self.fs.max_concurrency)) if c]:
                    first = len(sent.parts)
                    for chunk in chunks:
                        sent.add_part(chunk)
                    numbered = [(first + i + 1, chunk, sent.parts[first + i][0]) for i, chunk in enumerate(chunks)]
                    outs = await asyncio.gather(
                        *[
                            summed("upload_part", UploadId=upload, PartNumber=n, Body=chunk, ChecksumSHA256=sha)
                            for n, chunk, sha in numbered
                        ]
                    )
                    done += [
                        {"PartNumber": n, "ETag": o["ETag"], "ChecksumSHA256": sha}
                        for (n, _, sha), o in zip(numbered, outs)
                    ]
                await s3("complete_multipart_upload", UploadId=upload, MultipartUpload={"Parts": done})
            except BaseException:
                await s3("abort_multipart_upload", UploadId=upload)
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
        entries = self.fs.ls(self._p(rel), detail=True)
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

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
                return (
                    False,
                    f"{path} as sent does not match the manifest (the file changed on this box after its save)",
                )
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
        return {
            "size": head["ContentLength"],
            "sha256": head.get("ChecksumSHA256"),
            "etag": head.get("ETag", "").strip('"'),
            "kms": head.get("ServerSideEncryption") == "aws:kms",
        }

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
    """The part size of a multipart upload (s3fs.core.calculate_chunksize): 50 MiB, or S3's 10,000 parts."""
    return max(50 << 20, -(-size // 10_000))


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class SentDigests:
    """The digests of a file as uploaded: its sha256, and what the store will report of those bytes: S3's SHA-256
    (whole, or composite of the parts, '-N') and ETag (MD5, or of the parts' MD5s, '-N'), GCS's md5Hash."""

    def __init__(self, size: int):
        self.size = size
        self.parts: list[tuple[str, bytes]] = []  # (base64 SHA-256, raw MD5) of each part
        self._sha256, self._md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
        self.sha256 = self.s3_checksum = self.etag = self.gs_md5 = ""

    def add_part(self, data: bytes) -> None:
        self._sha256.update(data)
        self._md5.update(data)
        self.parts.append((_b64(hashlib.sha256(data).digest()), hashlib.md5(data, usedforsecurity=False).digest()))

    def done(self, multipart: bool) -> "SentDigests":
        self.sha256 = self._sha256.hexdigest()
        self.gs_md5 = _b64(self._md5.digest())
        if multipart:
            n = len(self.parts)
            self.s3_checksum = (
                _b64(hashlib.sha256(b"".join(base64.b64decode(p) for p, _ in self.parts)).digest()) + f"-{n}"
            )
            self.etag = hashlib.md5(b"".join(m for _, m in self.parts), usedforsecurity=False).hexdigest() + f"-{n}"
        else:
            self.s3_checksum = self.parts[0][0] if self.parts else _b64(hashlib.sha256().digest())
            self.etag = self._md5.hexdigest()
        return self

    @classmethod
    def of_file(cls, path: Path, part_bytes: Optional[int] = None, s3: bool = False) -> "SentDigests":
        """The same digests from the local file (sent by an earlier process), in the parts an S3 upload uses."""
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
                sent.parts = [(_b64(whole_sha.digest()), whole_md5.digest())]
            else:
                for chunk in iter(lambda: fh.read(part), b""):
                    sent.add_part(chunk)
        return sent.done(multipart)

    def matches(self, held: dict[str, Any]) -> Optional[bool]:
        """Whether the store holds these bytes, by its own checksum; None when it reports none we can compare."""
        if held.get("sha256"):  # S3 computed it on receipt (and checked ours): decisive either way
            # "-N" (N parts) from S3, not from some S3-compatible stores; base64 has no "-"
            return held["sha256"].split("-")[0] == self.s3_checksum.split("-")[0]
        if held.get("md5"):  # GCS's md5Hash of the object
            return held["md5"] == self.gs_md5
        if held.get("etag") and not held.get("kms") and held["etag"] == self.etag:
            # without SSE-KMS an ETag is the MD5 (of the parts' MD5s); one that differs may be another kind of ETag
            return True
        return None
