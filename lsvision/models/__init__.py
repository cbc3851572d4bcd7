"""timm-registered lsvision models, one file per family. Importing this package registers them all."""
from typing import List, Union

from timm.models import list_models as _timm_list_models
from timm.models import model_entrypoint as _model_entrypoint

from ._helpers import (  # noqa: F401  (checkpoint checks shared by tools/train.py and tools/validate.py)
    CheckpointMismatchError,
    check_state_dict_fits,
    checkpoint_arch,
    checkpoint_record,
    explain_checkpoint_errors,
    read_checked_state_dict,
    state_dict_mismatch,
)
from .cvt import *  # noqa: F401,F403
from .pvt import *  # noqa: F401,F403
from .pvt_v2_grc import *  # noqa: F401,F403
from .swin_grc import *  # noqa: F401,F403
from .vil_ls import *  # noqa: F401,F403
from .vit_grc import *  # noqa: F401,F403


def list_models(filter: Union[str, List[str]] = '') -> List[str]:
    """Names of the models lsvision registers with timm (fnmatch wildcards, as `timm.list_models`)."""
    return [n for n in _timm_list_models(filter) if _model_entrypoint(n).__module__.startswith('lsvision.')]
