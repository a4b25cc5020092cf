"""A run as the user drives it: the launch flow, the smoke test, the detached supervisor and its control, and the
views (facts.py reads a run's files, views.py words what a user reads about a run, summary_view.py its end,
task_eval_view.py its task scores, progress.py shows it live, commands.py builds the commands a user is shown).

May import: every other stage. Nothing imports run/ but launcher/cli.py.
"""
