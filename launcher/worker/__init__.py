"""The worker: the process that trains (smoke test or full run), the same code on CPU and GPU. train.py is its main
flow; engines/ has one module per engine, gpu_check/ the GPU check's steps (run on a lent GPU box).

May import: plan/ (sizing, models), data/, store/, the root leaves. Never run/ or deliver/.
"""
