"""The plan: what the job needs and which engine runs it, before any GPU time.

May import: the root leaves (errors, recipe, model_files). Never run/, worker/, deliver/.
"""
