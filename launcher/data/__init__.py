"""The training data: sources read, formats converted, examples counted and checked, the eval split drawn.

sources (a file, a folder, a Hub dataset, a mixture), formats (the format table: example lines, detection
order), dataset (read, convert, count, check), split (the held-out eval examples).

May import: the root leaves, store/ (file hashing). Never plan/, run/, worker/, deliver/.
"""
