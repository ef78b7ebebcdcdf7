"""specroute: an OpenAI-compatible router for a speculative and a standard engine pool."""

__version__ = "0.2.0"
