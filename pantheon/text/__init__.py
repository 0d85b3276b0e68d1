"""Text: what turns messages into ids and ids back into an answer.

The tokenizer, the chat template (Jinja2's sandbox), the emitter (stop strings, reasoning and
tool-call channels), tool formats and bare tool calls, and structured outputs (llguidance grammars).
JAX-free, so the web layer may use all of it.
"""
