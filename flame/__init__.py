"""flame: pretraining linear-attention language models."""
