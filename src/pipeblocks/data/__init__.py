"""Training data: tokenizers, corpora and memory-mapped token windows.

    >>> from pipeblocks.data import load_tokenizer, load_tokens
    >>> data = load_tokens("docs.jsonl", seq=1024, tokenizer="models/qwen2", vocab=151936)
    >>> train, held = data.split(0.05)
    >>> x, y = train.batch(step=0, batch_size=8, seed=0)

text.py: bytes and the embedded corpus; tokenizer.py: tokenizers; token_file.py: token
files and shards; tokenize.py: the tokenize-once cache; datasets_dir.py: saved Hugging Face
datasets; sources.py: `read_tokens`, which picks among them; windows.py: `TokenWindows` and `load_tokens`.
"""
from .sources import source_kind
from .text import ByteTokenizer, default_corpus, read_corpus
from .token_file import ShardedTokens
from .tokenizer import Tokenizer, check_tokenizer_fits, load_tokenizer
from .windows import TokenWindows, load_tokens

__all__ = [
    "ByteTokenizer", "ShardedTokens", "TokenWindows", "Tokenizer", "check_tokenizer_fits", "default_corpus",
    "load_tokenizer", "load_tokens", "read_corpus", "source_kind",
]
