"""The training data: sources read, formats converted, examples counted and checked, the eval split drawn.

sources (a file, a folder, a Hub dataset, a mixture), formats (the format table: example lines, detection
order), dataset (read, convert, count; records the chat template cannot render are refused), split (the held-out
eval examples), stats (`data_stats`: the statistics the plan uses, and the content check that refuses data which
would train nothing, never teach the model to stop, or lose its answers to max_length: loss_view `check`).

May import: the root leaves, store/ (file hashing). Never plan/, run/, worker/, deliver/.
"""
