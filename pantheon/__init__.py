"""Pantheon: a JAX-native LLM inference engine with an OpenAI-compatible streaming server."""

__version__ = "0.1.0"
