"""Copies checkpoints and the run's metadata off the box and back, each copy verified against its manifest.

kinds (the table of destinations) picks a Destination (base: the interface) from `sync.to`: hub, object_store, rsync,
one module per kind. transfer copies a run up (the supervisor's Syncer, keeping `sync.keep` copies) and down (`ftrun
pull`). The remote layout mirrors the run directory: checkpoints/step-NNNNNN/ (manifest.json last), final/, metadata.
"""

from launcher.store.sync.base import Destination
from launcher.store.sync.hub import HubDestination, git_blob_id, hub_retry_delay
from launcher.store.sync.kinds import KINDS, destination
from launcher.store.sync.object_store import FsspecDestination, SentDigests, s3_part_bytes
from launcher.store.sync.rsync import RsyncDestination
from launcher.store.sync.transfer import METADATA, Syncer, backoff_fields, metadata_digests, pull, push_checkpoint
from launcher.store.sync.transfer import push_final, push_metadata, remote_has_run, status_fields
