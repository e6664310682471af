"""hybridize: turn a pretrained Hugging Face decoder into a fast hybrid linear-attention model."""
__version__ = "0.1.0"
