"""The plan: what the job needs and which engine runs it, before any GPU time.

hardware (the box: detected, named or given; owns the GPU catalog, gpus.yaml), models (architecture, parameter
count, the pre-quantized repositories), sizing (pure arithmetic: memory, FLOPs, time), plan (engine choice,
processes, cost, each with its reason).

May import: the root leaves (errors, recipe, model_files). Never run/, worker/, deliver/.
"""
