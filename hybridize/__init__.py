"""hybridize: turn a pretrained Hugging Face decoder into a fast hybrid linear-attention model."""
__version__ = "0.1.0"

# registers model_type "hybridize" with AutoConfig / AutoModelForCausalLM (imports torch + transformers)
from hybridize import modeling as _modeling  # noqa: E402,F401
