"""rotkv: rotated INT2 KV cache for LLM inference."""

__version__ = "0.1.0"
