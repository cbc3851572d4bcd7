"""Embedded demo datasets, generated or read locally (no downloads)."""
from .digits import DIGITS_CLASSES, default_digits_root, export_digits
from .listops import LISTOPS_LRA, LISTOPS_MINI, ListOpsConfig, generate_listops, listops_value, listops_vocab
from .stdlib_bytes import stdlib_bytes
