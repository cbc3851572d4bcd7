"""Run tools/train.py and record every host sync it makes (run by tests/test_train.py, under torchrun).

`torch.Tensor.item` / `tolist` and `torch.distributed.all_reduce` are wrapped to record each call, with the phase of
the run ('setup', 'train' from the first training forward, 'eval' inside validation, 'end' at the final rank check),
whether it ran inside DDP's `no_sync`, and the all-reduced element count. Training forwards and optimizer steps are
recorded too. The records of each process go to `$SYNC_EVENTS.<rank>.json`, the GRC caches before and after the
first cache sync to `$SYNC_EVENTS.<rank>.caches`.

    torchrun --nproc_per_node=2 tests/count_host_syncs.py <tools/train.py arguments>
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

events = []
state = {'phase': 'setup', 'no_sync': False}


def record(kind: str, **extra) -> None:
    events.append(dict(kind=kind, phase=state['phase'], no_sync=state['no_sync'], **extra))


def counted(kind: str, fn):
    def wrapper(tensor, *args, **kwargs):
        record(kind, numel=tensor.numel())
        return fn(tensor, *args, **kwargs)
    return wrapper


torch.Tensor.item = counted('item', torch.Tensor.item)
torch.Tensor.tolist = counted('tolist', torch.Tensor.tolist)
dist.all_reduce = counted('all_reduce', dist.all_reduce)
register_optimizer_step_post_hook(lambda optimizer, args, kwargs: record('step'))

ddp_forward, ddp_no_sync = DistributedDataParallel.forward, DistributedDataParallel.no_sync


def forward(self, *args, **kwargs):
    if self.training:
        state['phase'] = 'train'
        record('forward')
    return ddp_forward(self, *args, **kwargs)


@contextlib.contextmanager
def no_sync(self):
    with ddp_no_sync(self):
        state['no_sync'] = True
        try:
            yield
        finally:
            state['no_sync'] = False


DistributedDataParallel.forward, DistributedDataParallel.no_sync = forward, no_sync

import lsvision.train.engine as engine  # noqa: E402  (after the patches, as the run sees them)

validate, check_ranks_agree = engine.validate, engine._check_ranks_agree
all_reduce_grc_caches = engine.all_reduce_grc_caches
first_cache_sync = []  # the caches before and after the first GRC cache sync


def recorded_cache_sync(layers):
    before = [m.cache.clone() for m in layers]
    all_reduce_grc_caches(layers)
    if not first_cache_sync:
        first_cache_sync.extend([before, [m.cache.clone() for m in layers]])


def phase_validate(*args, **kwargs):
    state['phase'] = 'eval'
    return validate(*args, **kwargs)


def phase_end(*args, **kwargs):
    state['phase'] = 'end'
    return check_ranks_agree(*args, **kwargs)


engine.validate, engine._check_ranks_agree = phase_validate, phase_end
engine.all_reduce_grc_caches = recorded_cache_sync

if __name__ == '__main__':
    from _helpers import load_tool  # imports lsvision: after the patches too
    code = load_tool('train').main(sys.argv[1:])
    out = f'{os.environ["SYNC_EVENTS"]}.{os.environ.get("RANK", "0")}'
    with open(f'{out}.json', 'w') as f:
        json.dump(events, f)
    torch.save(first_cache_sync, f'{out}.caches')
    sys.exit(code)
