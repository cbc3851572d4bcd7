"""timm-registered lsvision models, one file per family. Importing this package registers them all."""
from .cvt import *  # noqa: F401,F403
from .cvt_ls import *  # noqa: F401,F403
