"""What a run keeps on disk: the run directory's layout, its state, checkpoints, copies off the box, the final
result's check.

rundir (the layout), state (the state machine and the lock), checkpoint (folders and manifests), sync (the
copy destinations), final (the final model's check), modes (the results' permission bits, as the umask says).

May import: the root leaves. Nothing else of ftrun: every stage reads and writes through here.
"""
