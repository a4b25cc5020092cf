"""The delivered result: export (adapter, merged model, GGUF with its checks; its parts: parity, placement,
gguf_export, served_prompt with go_template, messages), llama.cpp, serving commands, publish to the Hub, the loss plot.

May import: data/, store/, plan/ (models), the root leaves. Never run/: the launch flow calls into here.
"""
