"""The worker: the process that trains (smoke test or full run), the same code on CPU and GPU. train.py is its main
flow; engines/ has one module per engine. The GPU check's steps, run on a lent GPU box, live in the checkout's
gpu_check/, outside the package: the product never imports them.

May import: plan/ (sizing, models), data/, store/, the root leaves. Never run/ or deliver/.
"""
