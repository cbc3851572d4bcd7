"""Embedded demo datasets, built from files already on the machine (no downloads)."""
from .digits import DIGITS_CLASSES, default_digits_root, export_digits
