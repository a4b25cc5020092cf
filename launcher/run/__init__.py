"""A run as the user drives it: the launch flow, the smoke test, the detached supervisor and its control, and the
views of a run.

May import: every other stage. Nothing imports run/ but launcher/cli.py.
"""
