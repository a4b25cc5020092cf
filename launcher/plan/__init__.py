"""The plan: what the job needs and which engine runs it, before any GPU time.

hardware (the box: detected, named or given; owns the GPU catalog, gpus.yaml), models (architecture, parameter
count, the pre-quantized repositories), sizing (pure arithmetic: memory, FLOPs, time), job (the recipe's job:
sequence length, batch shape, tokens, steps), engine (engine choice and process count, by the article's rules),
advice (other boxes, recipe changes that fit here, refusal wording), plan (the Plan: engine, processes, memory,
time, cost, each with its reason), text (the plan for a reader), figures (how hours, token counts and the memory
unit are written).

May import: the root leaves (errors, recipe, model_files). Never run/, worker/, deliver/.
"""
