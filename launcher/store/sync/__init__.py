"""Copies checkpoints and the run's metadata off the box and back, each copy verified against its manifest.

kinds (the table of destinations: hf://, fsspec URLs and paths, rsync over SSH) picks a Destination (base: the
interface) from `sync.to`: hub, object_store, rsync, one module per kind. transfer copies a run up (the Syncer
of the supervisor) and down (`ftrun pull`, a resume on a fresh box); its `push_checkpoint` keeps the newest
`sync.keep` copies (the box's own checkpoints: launcher/store/checkpoint.py `retain`). The remote layout mirrors
the run directory: checkpoints/step-NNNNNN/ (manifest.json uploaded last), final/, and the metadata files.
"""

from launcher.store.sync.base import Destination  # noqa: F401
from launcher.store.sync.hub import HubDestination, git_blob_id, hub_retry_delay  # noqa: F401
from launcher.store.sync.kinds import KINDS, destination  # noqa: F401
from launcher.store.sync.object_store import FsspecDestination, SentDigests, s3_part_bytes  # noqa: F401
from launcher.store.sync.rsync import RsyncDestination  # noqa: F401
from launcher.store.sync.transfer import (
    METADATA,
    Syncer,
    backoff_fields,
    metadata_digests,
    pull,  # noqa: F401
    push_checkpoint,
    push_final,
    push_metadata,
    remote_has_run,
    status_fields,
)
