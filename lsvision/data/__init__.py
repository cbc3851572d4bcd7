from .digits import DIGITS_CLASSES, default_digits_root, export_digits
