"""The cost and memory models: per-pass times and activation sizes (`costs`), data- and
tensor-parallel collective times, static memory by sharding policy, precision, and a
decoder's shape (read without torch, also from a Hugging Face config.json)."""
