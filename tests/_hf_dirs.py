"""Tiny Hugging Face model directories made on the spot: nothing is downloaded.

    path = make_model_dir(tmp_path / "qwen2", "Qwen2ForCausalLM", tied=True)
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok")

A directory holds what `save_pretrained` writes: config.json, model.safetensors (the
weights of a small random model, seeded) and the files of a byte-level BPE tokenizer
trained in a fraction of a second on Python's own help text (vocabulary 300, with
"<|endoftext|>" as EOS). Needs transformers and tokenizers (tests skip without them).
"""
from __future__ import annotations

from pathlib import Path

import pytest

TOKENIZER_VOCAB = 300
EOS = "<|endoftext|>"

# per architecture, the config class and the sizes of a tiny model of it
_TINY = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {"sliding_window": None}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": 8}),
    "GemmaForCausalLM": ("GemmaConfig", {"head_dim": 8}),
}
ARCHITECTURES = tuple(_TINY)


def corpus_text(chars: int = 200_000) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))[:chars]


def train_tokenizer(vocab: int = TOKENIZER_VOCAB):
    """A byte-level BPE `tokenizers.Tokenizer` with EOS, trained on Python's help text."""
    tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (pip install -e .[hf])")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text()], trainer)
    return tok


def save_tokenizer(directory: Path, tok=None) -> Path:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json) into `directory`."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")
    tok = tok or train_tokenizer()
    directory.mkdir(parents=True, exist_ok=True)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(directory))
    return directory


def make_tokenizer_dir(directory: Path) -> Path:
    return save_tokenizer(Path(directory))


def make_model_dir(directory: Path, architecture: str = "LlamaForCausalLM", *, tied: bool = False, layers: int = 4,
                   hidden: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 64, vocab: int = 320,
                   context: int = 128, seed: int = 0, dtype: str = "float32", tokenizer: bool = True,
                   max_shard_size: str | None = None, **extra) -> Path:
    """A directory with a tiny random `architecture` model (and its tokenizer) saved by save_pretrained."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")
    import torch

    directory = Path(directory)
    config_class, sizes = _TINY[architecture]
    tok = train_tokenizer() if tokenizer else None
    eos = tok.token_to_id(EOS) if tok is not None else 0
    config = getattr(transformers, config_class)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
        tie_word_embeddings=tied, eos_token_id=eos, bos_token_id=None, pad_token_id=None, **{**sizes, **extra})
    config.architectures = [architecture]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, architecture)(config).to(getattr(torch, dtype))
    finally:
        torch.random.set_rng_state(generator_state)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    if tok is not None:
        save_tokenizer(directory, tok)
    return directory
