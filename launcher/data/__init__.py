"""The training data: sources read, formats converted, examples counted and checked, the eval split drawn.

May import: the root leaves, store/ (file hashing). Never plan/, run/, worker/, deliver/.
"""
