"""Sequence models (LRA encoders, character LMs, HSW, Transformer-XL word LMs, translation) on lsvision's attention
layers, with a registry of their own.

`lsvision.sequence.create_model(name, **kwargs)` and `lsvision.sequence.list_models()` work like timm's.
"""
from ._registry import create_model, is_model, list_models, register_model
from .char_lm import CharLM, LMState
from .hsw import HSW, FlatEncoder
from .lra import LraClassifier, LraDualClassifier, LraEncoder
from .transformer_xl import GrcStreamState, TransformerXL, TxlState
from .translation import DecoderState, EncoderOut, TranslationTransformer
