"""lsvision.detection's detectors: torchvision's Mask R-CNN (and Faster R-CNN, RetinaNet) on every hierarchical
family's timm features, at sizes the detector's transform does not round to the backbone's strides; backbone weights
from files, and the errors for files and weights that cannot load."""
import argparse
import functools

import pytest
import torch
from _helpers import ROOT, TINY_CONFIGS, grc_caches, grc_modules, load_tool
from safetensors.torch import save_file
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

import timm

from lsvision import bench, detection
from lsvision.models._helpers import CheckpointMismatchError
from lsvision.models._pretrained import NoPretrainedWeightsError
from lsvision.reports import write_reports
from lsvision.train import save_atomic

# one tiny config per hierarchical family, with and without GRC where both exist (timm's own PVT v2 in the tiny
# sizes of lsvision's PVT v2 GRC config)
FAMILIES = {
    name: TINY_CONFIGS[name] for name in (
        'cvt_13', 'cvt_ls_13', 'vil_ls_medium', 'pvt_tiny', 'pvt_tiny_grc', 'pvt_v2_b0_grc',
        'swin_tiny_patch4_window7_224_grc')
}
FAMILIES['pvt_v2_b0'] = dict(depths=(1, 1, 1, 1))
FPN = 16  # FPN channels of the tiny detectors
NUM_CLASSES = 3  # two object classes and the background

# backbone tensors that no detection loss reaches on these inputs, with the reason:
# - ViL-LS: the global-to-global bias of the last block before a stage ends only acts on the cls query, whose output
#   the stage drops (the next stage starts from the patch map);
# - GRC: the reset gate's weights on the first step: the cache starts at zero, so g_r * C = 0 (Cached Transformers,
#   Eq. 3)
NO_GRADIENT = ('attn.rel_pos_g2g', 'attn.grc.linear_reset.')


def tiny_mask_rcnn(name: str, **kwargs) -> MaskRCNN:
    """Mask R-CNN on the tiny config of `name` with small heads and few proposals (min_size 64)."""
    torch.manual_seed(0)
    return detection.mask_rcnn(
        name, num_classes=None, model_kwargs=FAMILIES[name], fpn_channels=FPN, min_size=64, max_size=128,
        rpn_pre_nms_top_n_train=64, rpn_post_nms_top_n_train=32, rpn_pre_nms_top_n_test=64,
        rpn_post_nms_top_n_test=32, rpn_batch_size_per_image=32, box_batch_size_per_image=16,
        box_detections_per_img=8, box_head=TwoMLPHead(FPN * 7 * 7, 32),
        box_predictor=FastRCNNPredictor(32, NUM_CLASSES), mask_head=MaskRCNNHeads(FPN, [FPN, FPN], 1),
        mask_predictor=MaskRCNNPredictor(FPN, FPN, NUM_CLASSES), **kwargs)


def images_and_targets():
    """Two images whose resized sizes (64 x 93 and 85 x 64) are no multiple of 32, with a box and an exact mask
    for each of two objects."""
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 75, 110, generator=g), torch.rand(3, 94, 70, generator=g)]
    targets = []
    for img in images:
        h, w = img.shape[1:]
        boxes = torch.tensor([[5., 6., 40., 50.], [20., 15., 60., 70.]])
        masks = torch.zeros(2, h, w, dtype=torch.uint8)
        for m, (x0, y0, x1, y1) in zip(masks, boxes.int().tolist()):
            m[y0:y1, x0:x1] = 1
        targets.append(dict(boxes=boxes, labels=torch.tensor([1, 2]), masks=masks))
    return images, targets


def check_grc_caches(model: MaskRCNN, images, targets, detections) -> None:
    """After a training forward and an evaluation (`detections`): training forwards store the batch's cache update
    (the next forward sees it); evaluation neither reads other images into the cache nor changes it, so detections
    are a function of weights, caches and images; the DDP all-reduce of `detection.grc_layers` is a no-op without a
    process group."""
    layers = detection.grc_layers(model)
    assert layers == grc_modules(model.backbone.body) and layers
    before = grc_caches(model)
    with torch.no_grad():
        model.train()(images, targets)
        after = grc_caches(model)
        assert all(not torch.equal(a, b) for a, b in zip(before, after))
        again = model.eval()(images)
    assert all(torch.equal(a, b) for a, b in zip(after, grc_caches(model)))
    assert any(not torch.equal(a['scores'], b['scores']) for a, b in zip(detections, again))  # the new caches
    with torch.no_grad():
        repeat = model(images)
    for a, b in zip(again, repeat):
        assert all(torch.equal(a[k], b[k]) for k in a)
    detection.all_reduce_grc_caches(layers)
    assert all(torch.equal(a, b) for a, b in zip(after, grc_caches(model)))


@pytest.mark.parametrize('name', list(FAMILIES))
def test_mask_rcnn_trains_and_detects(name):
    """Train mode: losses, and a gradient in every backbone tensor; eval mode: boxes, labels, scores and masks at
    each image's size (GRC models: their caches, see check_grc_caches)."""
    model = tiny_mask_rcnn(name)
    assert isinstance(model, MaskRCNN)
    images, targets = images_and_targets()
    model.train()
    losses = model(images, targets)
    assert set(losses) == {'loss_classifier', 'loss_box_reg', 'loss_mask', 'loss_objectness', 'loss_rpn_box_reg'}
    assert all(v.isfinite() for v in losses.values())
    sum(losses.values()).backward()
    body = dict(model.backbone.body.named_parameters())
    assert all(p.grad is not None and p.grad.isfinite().all() for p in body.values())
    zero = [k for k, p in body.items() if not p.grad.any()]
    assert [k for k in zero if not any(s in k for s in NO_GRADIENT)] == []
    assert len(zero) < len(body) // 4

    model.eval()
    with torch.no_grad():
        detections = model(images)
    if grc_modules(model):
        check_grc_caches(model, images, targets, detections)
    for det, img in zip(detections, images):
        n = det['boxes'].shape[0]
        assert det['boxes'].shape == (n, 4) and det['labels'].shape == det['scores'].shape == (n,)
        assert det['masks'].shape == (n, 1, *img.shape[1:])
        if n:
            assert det['boxes'][:, 2].max() <= img.shape[2] and det['boxes'][:, 3].max() <= img.shape[1]


@pytest.mark.parametrize('name,levels', [('cvt_ls_13', 'rcnn'), ('cvt_ls_13', 'retinanet'),
                                         ('swin_tiny_patch4_window7_224_grc', 'rcnn')])
def test_fpn_levels_at_any_size(name, levels):
    """Five levels at strides 4-64 (R-CNN) or 8-128 (RetinaNet) on an input no stride divides (Swin: padded to
    whole patches); a three-stage backbone (CvT-LS) gets its coarsest levels from its last one."""
    torch.manual_seed(0)
    backbone = detection.backbone_with_fpn(name, model_kwargs=FAMILIES[name], out_channels=FPN, levels=levels).eval()
    names, strides = {'rcnn': (['0', '1', '2', '3', 'pool'], [4, 8, 16, 32, 64]),
                      'retinanet': (['p3', 'p4', 'p5', 'p6', 'p7'], [8, 16, 32, 64, 128])}[levels]
    assert backbone.strides == strides and backbone.out_channels == FPN
    with torch.no_grad():
        out = backbone(torch.randn(1, 3, 50, 75))
    assert list(out) == names and all(v.shape[:2] == (1, FPN) for v in out.values())
    shapes = [tuple(v.shape[2:]) for v in out.values()]
    s = strides[0]
    assert shapes[0][0] in (50 // s, -(-50 // s)) and shapes[0][1] in (75 // s, -(-75 // s))
    for (h, w), (h2, w2) in zip(shapes, shapes[1:]):  # each level halves (rounding up) the one before
        assert (h2, w2) == ((h + 1) // 2, (w + 1) // 2)


def test_extra_levels_are_torchvisions():
    """ExtraLevels computes what torchvision's LastLevelMaxPool and LastLevelP6P7(C, C) compute."""
    torch.manual_seed(0)
    p = [torch.randn(1, 8, 13, 9)]
    pooled, names = detection.ExtraLevels(['pool'], 'pool')(list(p), [], ['0'])
    expected, expected_names = LastLevelMaxPool()(list(p), [], ['0'])
    assert names == expected_names and torch.equal(pooled[-1], expected[-1])
    ours, theirs = detection.ExtraLevels(['p6', 'p7'], 'conv', 8), LastLevelP6P7(8, 8)
    ours.convs[0].load_state_dict(theirs.p6.state_dict())
    ours.convs[1].load_state_dict(theirs.p7.state_dict())
    out, names = ours(list(p), [], ['p5'])
    expected, expected_names = theirs(list(p), list(p), ['p5'])
    assert names == expected_names
    assert all(torch.equal(a, b) for a, b in zip(out, expected))


def test_faster_rcnn_and_retinanet_train():
    images, targets = images_and_targets()
    for build, cls in ((detection.faster_rcnn, FasterRCNN), (detection.retinanet, RetinaNet)):
        torch.manual_seed(0)
        small = dict(rpn_pre_nms_top_n_train=64, rpn_post_nms_top_n_train=32, rpn_batch_size_per_image=32,
                     box_batch_size_per_image=16, box_head=TwoMLPHead(FPN * 7 * 7, 32),
                     box_predictor=FastRCNNPredictor(32, NUM_CLASSES)) if cls is FasterRCNN else {}
        model = build('cvt_ls_13', num_classes=None if small else NUM_CLASSES, model_kwargs=FAMILIES['cvt_ls_13'],
                      fpn_channels=FPN, min_size=64, max_size=128, **small)
        assert isinstance(model, cls)
        losses = model.train()(images, [{k: v for k, v in t.items() if k != 'masks'} for t in targets])
        assert losses and all(v.isfinite() for v in losses.values())


def _body_state(model: MaskRCNN):
    """The backbone's tensors under the classification model's names (the feature wrapper's `model.` dropped)."""
    return {k[len('model.'):]: v for k, v in model.backbone.body.state_dict().items()}


@pytest.mark.parametrize('fmt', ['safetensors', 'train_checkpoint'])
def test_backbone_weights_from_a_file(tmp_path, fmt):
    """A classification model's weights (10 classes) load into the backbone; the head is left out."""
    torch.manual_seed(1)
    source = timm.create_model('cvt_ls_13', num_classes=10, **FAMILIES['cvt_ls_13'])
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.)  # away from any init
    if fmt == 'safetensors':
        path = tmp_path / 'weights.safetensors'
        save_file(source.state_dict(), str(path))
    else:  # as tools/train.py writes its checkpoints: the EMA weights are the ones loaded
        path = tmp_path / 'last.pth.tar'
        raw = {k: v - 1. if v.is_floating_point() else v for k, v in source.state_dict().items()}
        save_atomic({'arch': 'cvt_ls_13', 'epoch': 3, 'state_dict': raw, 'state_dict_ema': source.state_dict()},
                    str(path))
    model = tiny_mask_rcnn('cvt_ls_13', backbone_weights=str(path))
    loaded, expected = _body_state(model), source.state_dict()
    assert set(expected) - set(loaded) == {'head.weight', 'head.bias', 'norm.weight', 'norm.bias'}  # pruned
    assert all(torch.equal(v, expected[k]) for k, v in loaded.items())


def test_grc_backbone_from_its_timm_base(tmp_path):
    """A timm PVT v2 checkpoint loads into the GRC backbone; only the `.grc.` tensors start fresh (zero caches)."""
    torch.manual_seed(1)
    base = timm.create_model('pvt_v2_b0', depths=(1, 1, 1, 1))
    path = tmp_path / 'pvt_v2_b0.pth'
    torch.save(base.state_dict(), path)
    model = tiny_mask_rcnn('pvt_v2_b0_grc', backbone_weights=str(path))
    loaded, expected = _body_state(model), base.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.items() if '.grc.' not in k)
    assert {k for k in loaded if k not in expected} == {k for k in loaded if '.grc.' in k}
    assert all(not c.any() for c in grc_caches(model))


def test_mismatched_file_is_explained(tmp_path):
    path = tmp_path / 'cvt_13.pth.tar'
    save_atomic({'arch': 'cvt_13', 'state_dict': timm.create_model('cvt_13', **FAMILIES['cvt_13']).state_dict()},
                str(path))
    with pytest.raises(CheckpointMismatchError, match=r'does not fit cvt_ls_13 \(it holds cvt_13 weights\).*missing.*'
                                                      r'Fix: load it into cvt_13, or use a checkpoint of cvt_ls_13'):
        tiny_mask_rcnn('cvt_ls_13', backbone_weights=str(path))
    with pytest.raises(FileNotFoundError, match="backbone_weights '.*nothing.pth' is not a file"):
        tiny_mask_rcnn('cvt_ls_13', backbone_weights=str(tmp_path / 'nothing.pth'))


def test_pretrained_without_released_weights_is_explained(tmp_path):
    with pytest.raises(NoPretrainedWeightsError, match=r'cvt_ls_13 has no released weights \(its model card, '
                                                       r'model_cards/cvt_ls_13.md.*backbone_weights=None'):
        tiny_mask_rcnn('cvt_ls_13', backbone_weights='pretrained')
    # following the hint: random weights, or a file of the model's weights
    path = tmp_path / 'cvt_ls_13.safetensors'
    save_file(timm.create_model('cvt_ls_13', **FAMILIES['cvt_ls_13']).state_dict(), str(path))
    for weights in (None, str(path)):
        assert isinstance(tiny_mask_rcnn('cvt_ls_13', backbone_weights=weights), MaskRCNN)


def test_detector_input_size():
    """The resolution benchmark measures what the detector's transform makes of its image sizes."""
    assert detection.detector_input_size(800, 1333) == (800, 1344)
    assert detection.detector_input_size(1024, 1024) == (1024, 1024)


def test_bench_train_step_on_fpn_levels():
    """lsvision.bench's train step takes a dict of levels (the sum of their means) and updates with AdamW (SGD at
    lr 0 leaves the weights as they were)."""
    build = functools.partial(detection.backbone_with_fpn, 'cvt_ls_13', model_kwargs=FAMILIES['cvt_ls_13'],
                              out_channels=FPN)
    for optimizer in ('sgd', 'adamw'):
        job = bench.Job(label='cvt_ls_13', build=build, inputs=[((3, 40, 56), None)], kind='train', warmup=0,
                        budget_s=0., optimizer=optimizer, memory=False)
        torch.manual_seed(0)
        model = build()
        before = [p.detach().clone() for p in model.parameters()]
        bench._step(model, bench._inputs(model, job, torch.device('cpu')), job, torch.device('cpu'))()
        moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
        assert all(moved) if optimizer == 'adamw' else not any(moved)
        assert all(p.grad is None for p in model.parameters())  # zeroed for the next step
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adamw', got 'adam'"):
        bench.Job(label='x', build=build, optimizer='adam')


def _run(label: str, seconds: float, peak: float, image: str = '800x1333'):
    """One process's row as lsvision.bench.measure returns it (one timed pass)."""
    return dict(label=label, params=1, input_size=[3, 800, 1344], batch_size=1, pid=0, peak_mib=peak, image=image,
                timing=dict(bench.timing_stats([seconds], 1), cpu_per_pass_s=seconds))


def test_report_has_the_ratios_to_the_baseline():
    """The report's summary: each model's forward / train time and memory, and their ratios to the baseline's
    ('-' for what was not measured, here the training of the forward-only run)."""
    rows = [dict(bench.combine({'inference': [_run(name, t, m)]}), spec=name, point=[800, 1333], baseline='cvt_13')
            for name, t, m in (('cvt_ls_13', 2.0, 100.), ('cvt_13', 8.0, 400.))]
    bench.add_ratios(rows)
    settings = dict(command='python tools/benchmark.py detection', commit='abc1234')
    text = load_tool('benchmark').dense_markdown(rows, settings, 'a machine')
    assert 'Produced by `python tools/benchmark.py detection` at commit `abc1234`.' in text
    forward, train = text.split('### Forward')[1].split('### Training step (AdamW)')
    assert '| cvt_ls_13 | 800x1333 | 800x1344 | 2000 | 2000 | 100 | 0.25x | 0.25x | 0.25x |' in forward
    assert '| cvt_13 | 800x1333 | 800x1344 | 8000 | 8000 | 400 | 1.00x | 1.00x | 1.00x |' in forward
    assert 'Not measured.' in train.split('###')[0]


def test_detection_benchmark_command_line(tmp_path):
    """`tools/benchmark.py detection`: its sizes, and --from-json writing a stored report's markdown again."""
    tool = load_tool('benchmark')
    rows = [dict(bench.combine({'inference': [_run('cvt_13', 1.0, 10.)]}), spec='cvt_13', point=[800, 1333],
                 baseline='cvt_13')]
    write_reports(rows, tmp_path / 'r', 'old', dict(command='python tools/benchmark.py detection', commit='abc1234',
                                                    note='Loaded.', complete=False))
    assert tool.main(['detection', '--from-json', str(tmp_path / 'r.json')]) == 0  # measures nothing
    text = (tmp_path / 'r.md').read_text()
    assert 'at commit `abc1234`' in text and 'Loaded. Partial: 800x1333 measured so far.' in text
    assert '| cvt_13 | 800x1333 | 800x1344 | 1000 | 1000 | 10 |' in text
    assert 'load average when the JSON was written' in text  # 'old' had no machine line
    (tmp_path / 'r.md').write_text('Measured on: the machine at the start.\n')
    tool.main(['detection', '--from-json', str(tmp_path / 'r.json')])
    assert 'Measured on: the machine at the start.' in (tmp_path / 'r.md').read_text()
    args = tool.parse_args(['detection', '--sizes', '800x1333', '1024x1024', '--bench', 'inference'])
    assert args.sizes == [(800, 1333), (1024, 1024)] and args.baseline in args.models
    with pytest.raises(SystemExit):
        tool.parse_args(['detection', '--sizes', '800'])
    with pytest.raises(argparse.ArgumentTypeError, match="'800x16': both numbers must be at least 32"):
        tool.parse_pair('800x16', minimum=32)


def test_docs_quote_the_benchmark_reports():
    """docs/detection.md's benchmark numbers are those of the committed reports (CPU-time and memory ratios to
    cvt_13, memory in GiB)."""
    docs = ' '.join((ROOT / 'docs' / 'detection.md').read_text().split())

    def rows(name):
        return {(r['label'], r['image']): r for r in bench.read_report(ROOT / 'docs' / 'benchmarks' / name)['rows']}

    full, second = rows('detection.json'), rows('detection_1024.json')
    images = ('800x1333', '1024x1024')

    def cpu(table, model, image, kind):
        key = f'{kind}_cpu_ms_per_image'
        return f"{table[model, image][key] / table['cvt_13', image][key]:.2f}x"

    assert (f"training step took {cpu(full, 'cvt_ls_13', images[0], 'train')} (800 x 1333) and "
            f"{cpu(full, 'cvt_ls_13', images[1], 'train')} (1024 x 1024) the CPU time of cvt_13's, its forward "
            f"{cpu(full, 'cvt_ls_13', images[0], 'inference')} and {cpu(full, 'cvt_ls_13', images[1], 'inference')} "
            f"({cpu(second, 'cvt_ls_13', images[1], 'inference')} in the second run); PVT-Small's training step "
            f"{cpu(full, 'pvt_small', images[0], 'train')} and {cpu(full, 'pvt_small', images[1], 'train')}, "
            f"PVT-Small-GRC's {cpu(full, 'pvt_small_grc', images[0], 'train')} and "
            f"{cpu(full, 'pvt_small_grc', images[1], 'train')}.") in docs
    gib = [f"{full[m, i]['train_memory_mib'] / 1024:.1f}" for m in ('cvt_ls_13', 'cvt_13') for i in images]
    ratios = [f"{full['cvt_ls_13', i][k]:.2f}x" for k in ('train_memory_ratio', 'peak_ratio') for i in images]
    assert (f'was {gib[0]} and {gib[1]} GiB for cvt_ls_13 against {gib[2]} and {gib[3]} GiB for cvt_13 ({ratios[0]} '
            f"and {ratios[1]}), the forward's {ratios[2]} and {ratios[3]} of cvt_13's") in docs
    all_ratios = [r[k] for r in full.values() for k in ('train_memory_ratio', 'peak_ratio')]
    assert f"within {min(all_ratios):.2f}x-{max(all_ratios):.2f}x of cvt_13's for all four" in docs
