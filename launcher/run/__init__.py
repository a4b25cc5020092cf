"""A run as the user drives it: the launch flow, the smoke test, the detached supervisor, and the views
(every text a user reads about a run: status, list, progress, summary).

May import: every other stage. Nothing imports run/ but launcher/cli.py.
"""
