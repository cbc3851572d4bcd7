"""lsvision: efficient long-range attention backbones for timm.

`import lsvision` registers every lsvision model with timm, so `timm.create_model('cvt_ls_13')` works.
"""
from . import layers, models, sequence  # noqa: F401  (importing models registers them with timm)

__version__ = '0.1.0'
