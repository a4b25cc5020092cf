"""The worker: the process that trains (smoke test or full run), the same code on CPU and GPU.

train (the worker's main loop), loading, memory, saving, window (the logging window), trackers, samples;
engines/ (one module per engine); gpu_check (the GPU check script's steps, run on a lent GPU box).

May import: plan/ (sizing, models), data/, store/, the root leaves. Never run/ or deliver/.
"""
