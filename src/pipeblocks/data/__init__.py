"""Training data for the reference GPT: byte tokens in fixed-length windows."""
from .text import ByteTokenizer, TokenWindows, default_corpus, read_corpus

__all__ = ["ByteTokenizer", "TokenWindows", "default_corpus", "read_corpus"]
