"""Training: tokenizer, data shards, the torch model, pre-training and SFT, export (torch extra)."""
