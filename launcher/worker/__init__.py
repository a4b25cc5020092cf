"""The worker: the process that trains (smoke test or full run), the same code on CPU and GPU.

train (the worker's main flow) with its parts: process (rank, stop request), exits (exit codes, failure records),
checkpointing (checkpoints shared by the ranks), callbacks (the trainer callbacks), trainer_config (SFTConfig),
inputs (the data read back), results (smoke measurements, final result), loss_plot; loading, memory, saving,
window (the logging window), trackers, samples, task_eval (the task's answers and scores);
engines/ (one module per engine); gpu_check/ (the GPU check's steps, run on a lent GPU box: one module per check).

May import: plan/ (sizing, models), data/, store/, the root leaves. Never run/ or deliver/.
"""
