"""Embedded demo datasets, generated or read locally (no downloads)."""
from .listops import LISTOPS_LRA, LISTOPS_MINI, ListOpsConfig, generate_listops, listops_value, listops_vocab
from .stdlib_bytes import stdlib_bytes
