"""What a run keeps on disk: rundir (the layout), state (the state machine and the lock), checkpoint (folders and
manifests), sync (copies off the box), final (the final result's check), modes (the results' permission bits).

May import: the root leaves. Nothing else of ftrun: every stage reads and writes through here.
"""
