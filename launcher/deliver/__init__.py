"""The delivered result: the export (adapter, merged model, GGUF, each checked), llama.cpp, serving commands,
publishing to the Hub, the loss plot.

May import: worker/ (loading, task evaluation), plan/, data/, store/, the root leaves. Never run/: the launch flow
calls into here.
"""
