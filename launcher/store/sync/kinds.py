"""The copy destinations ftrun knows: one table (KINDS), in the order a `sync.to` value is matched against it.

The recipe's `sync.to` description, the refusal of a value no kind takes, and the launch's advice derive from it;
tests/test_tables.py walks every kind through `destination`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from launcher.errors import SyncError
from launcher.store.sync.base import Destination
from launcher.store.sync.hub import HubDestination
from launcher.store.sync.object_store import FsspecDestination
from launcher.store.sync.rsync import RsyncDestination

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SCP_LIKE = re.compile(r"^(?:[^@/:\s]+@)?[A-Za-z0-9._-]+:(?!//)")


@dataclass(frozen=True)
class Kind:
    name: str
    forms: tuple[str, ...]  # how sync.to is written for this kind, as help texts and errors show it
    example: str  # one concrete value of this kind (tests/test_tables.py walks it through `destination`)
    matches: Callable[[str], bool]
    verification: str  # how a copied file is proven to be the one sent (docs/sync.md)
    cls: type[Destination]  # its Destination (one module per kind beside this one)
    problem: Callable[[str], Optional[str]]  # what a value of this kind lacks, checked when the recipe loads


# The fsspec protocols ftrun copies to (stores that take writes and keep them), each with its backend package
FSSPEC_PROTOCOLS = {"file": None, "local": None, "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
FSSPEC_PROTOCOLS.update(az="adlfs", abfs="adlfs", abfss="adlfs", sftp="paramiko")
BUCKETS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def _fsspec_problem(url: str) -> Optional[str]:
    if url.startswith("/"):
        return None
    protocol, rest = url.split("://", 1)
    if protocol not in FSSPEC_PROTOCOLS:
        others = [f for k in KINDS if k.problem is not _fsspec_problem for f in k.forms]  # the other kinds' forms
        return (
            f"'{protocol}://' is not a destination ftrun copies to; it takes "
            + ", ".join(f"{p}://" for p in FSSPEC_PROTOCOLS)
            + f", or {' or '.join(others)}"
        )
    if protocol in BUCKETS and not rest.split("/", 1)[0]:
        return f"{url} names no bucket: write {protocol}://BUCKET/PREFIX"
    if protocol == "sftp" and not rest.split("/", 1)[0]:
        return f"{url} names no host: write sftp://HOST/PATH"
    import importlib.util

    package = FSSPEC_PROTOCOLS[protocol]
    if package and importlib.util.find_spec(package) is None:
        return f"{protocol}:// needs the {package} package, which is not installed here: pip install {package}"
    return None


def _hub_problem(url: str) -> Optional[str]:
    parts = url[len("hf://") :].split("/", 2)
    if len(parts) < 2 or not all(parts[:2]):
        return f"{url} names no repo: write hf://USER/REPO (or hf://USER/REPO/FOLDER)"
    return None


def _rsync_problem(url: str) -> Optional[str]:
    return None if url.split(":", 1)[1] else f"{url} names no folder on the host: write user@host:/path"


KINDS: tuple[Kind, ...] = (
    Kind(
        "hub",
        ("hf://user/repo",),
        "hf://user/repo",
        lambda url: url.startswith("hf://"),
        "the Hub's own listing: LFS sha256 or git blob id and size per file, one commit per copy",
        HubDestination,
        _hub_problem,
    ),
    Kind(
        "fsspec",
        ("s3://bucket/prefix", "gs://...", "file:///path", "an absolute path"),
        "s3://bucket/prefix",
        lambda url: bool(_SCHEME.match(url)) or url.startswith("/"),
        "S3's SHA-256 per object (per part), GCS's MD5; read back and hashed where a store has neither",
        FsspecDestination,
        _fsspec_problem,
    ),
    Kind(
        "rsync",
        ("user@host:/path", "an SSH alias alias:/path"),
        "user@host:/path",
        lambda url: bool(_SCP_LIKE.match(url)),
        "rsync --checksum against the folder sent: nothing may differ",
        RsyncDestination,
        _rsync_problem,
    ),
)


def forms(sep: str = ", ") -> str:
    """Every form of every kind, for help texts and errors."""
    return sep.join(f for k in KINDS for f in k.forms)


def kind_of(url: str) -> Kind:
    for kind in KINDS:
        if kind.matches(url):
            return kind
    raise SyncError(
        f"sync.to={url!r} is not a destination ftrun knows",
        fix="use " + "; ".join(f"{' or '.join(k.forms)} ({k.name})" for k in KINDS) + ".",
    )


def problem(url: str) -> Optional[str]:
    """What is wrong with a sync.to value before anything is copied (no network), or None; credentials and
    reachability are checked when the run opens the destination."""
    for kind in KINDS:
        if kind.matches(url):
            return kind.problem(url)
    return f"{url!r} is not a destination ftrun knows: write " + "; ".join(
        f"{' or '.join(k.forms)} ({k.name})" for k in KINDS
    )


def destination(url: str) -> Destination:
    return kind_of(url).cls(url)
