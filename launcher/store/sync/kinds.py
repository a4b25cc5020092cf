"""The copy destinations ftrun knows: one table (KINDS), in the order a `sync.to` value is matched against it.

Each kind has the forms a user writes, how its copies are proven, and the module with its Destination. The recipe's
`sync.to` description, the refusal of a value no kind takes, and the launch's advice derive from this table;
tests/test_tables.py walks every kind through `destination`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

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


KINDS: tuple[Kind, ...] = (
    Kind("hub", ("hf://user/repo",), "hf://user/repo", lambda url: url.startswith("hf://"),
         "the Hub's own listing: LFS sha256 or git blob id and size per file, one commit per copy",
         HubDestination),
    Kind("fsspec", ("s3://bucket/prefix", "gs://...", "file:///path", "an absolute path"), "s3://bucket/prefix",
         lambda url: bool(_SCHEME.match(url)) or url.startswith("/"),
         "S3's SHA-256 per object (per part), GCS's MD5; read back and hashed where a store has neither",
         FsspecDestination),
    Kind("rsync", ("user@host:/path", "an SSH alias alias:/path"), "user@host:/path", lambda url: bool(_SCP_LIKE.match(url)),
         "rsync --checksum against the folder sent: nothing may differ",
         RsyncDestination),
)


def forms(sep: str = ", ") -> str:
    """Every form of every kind, for help texts and errors."""
    return sep.join(f for k in KINDS for f in k.forms)


def kind_of(url: str) -> Kind:
    for kind in KINDS:
        if kind.matches(url):
            return kind
    raise SyncError(f"sync.to={url!r} is not a destination ftrun knows",
                    fix="use " + "; ".join(f"{' or '.join(k.forms)} ({k.name})" for k in KINDS) + ".")


def destination(url: str) -> Destination:
    """The Destination for `url` (launcher/store/sync/base.py is the interface)."""
    return kind_of(url).cls(url)
