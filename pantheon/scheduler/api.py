"""The seam between the web layer and whatever generates tokens for a model: the request-side types
(`pantheon.types`, JAX-free) re-exported where the schedulers and their tests expect them."""

from pantheon.types import Backend, Event, Finished, GenRequest, Handle, Sink, Started, TokenLogprob, Tokens

__all__ = ["Backend", "Event", "Finished", "GenRequest", "Handle", "Sink", "Started", "TokenLogprob", "Tokens"]
