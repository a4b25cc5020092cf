"""The worker: the process that trains (smoke test or full run), the same code on CPU and GPU; train.py is its main
flow, engines/ one module per engine. The GPU check's steps live in the checkout's gpu_check/, never imported here.

May import: plan/ (sizing, models), data/, store/, the root leaves. Never run/ or deliver/.
"""
