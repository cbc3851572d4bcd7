"""lsvision.segmentation: Semantic FPN and UperNet on every hierarchical family at sizes no stride divides, the
metric (mmsegmentation's mIoU / mAcc / aAcc) on hand-computed cases, sliding-window inference against whole-image,
the data layouts and their errors, and the training pipeline."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from _helpers import TINY_CONFIGS
from PIL import Image

from lsvision import segmentation
from lsvision.eval.segmentation import SegmentationMetric, intersect_and_union, metrics_from_areas
from lsvision.segmentation.data import (
    SegmentationDataError,
    SegmentationDataset,
    TrainPipeline,
    ade20k_pairs,
    cityscapes_pairs,
    folder_pairs,
    rescale_size,
)
from lsvision.segmentation.inference import predict, slide_inference

# one tiny config per hierarchical family, with and without GRC (timm's own PVT v2 in lsvision's tiny PVT v2 sizes)
FAMILIES = {name: TINY_CONFIGS[name] for name in (
    'cvt_13', 'cvt_ls_13', 'vil_ls_medium', 'pvt_tiny', 'pvt_tiny_grc', 'pvt_v2_b0_grc',
    'swin_tiny_patch4_window7_224_grc')}
FAMILIES['pvt_v2_b0'] = dict(depths=(1, 1, 1, 1))
HEADS = {'semantic_fpn': dict(fpn_channels=16, channels=8), 'upernet': dict(channels=8)}


@pytest.mark.parametrize('head', list(HEADS))
@pytest.mark.parametrize('name', list(FAMILIES))
def test_every_family_trains_a_step(name, head):
    """A training step at 50 x 75 (no multiple of any stride): logits at the input's size, a finite loss, a gradient
    in every head tensor and in the backbone, an optimizer update; then eval-mode logits at the input's size."""
    torch.manual_seed(0)
    model = getattr(segmentation, head)(name, 3, model_kwargs=FAMILIES[name], **HEADS[head])
    x, y = torch.randn(2, 3, 50, 75), torch.randint(0, 3, (2, 50, 75))
    y[:, :5] = segmentation.IGNORE_INDEX
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    logits = model(x)
    assert logits.shape == (2, 3, 50, 75)
    loss = segmentation.segmentation_loss(logits, y)
    assert loss.isfinite()
    loss.backward()
    assert all(p.grad is not None for p in model.decode_head.parameters())
    assert any(p.grad is not None and p.grad.any() for p in model.body.parameters())
    optimizer.step()
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 3, 50, 75)


def test_head_structure():
    """Semantic FPN: log2(stride / 4) conv stages per level (one at stride 4), 2x upsampling after each where the
    level is coarser; UperNet: a pooling branch per scale and one lateral / output conv per level but the last."""
    torch.manual_seed(0)
    fpn = segmentation.semantic_fpn('pvt_tiny', 5, model_kwargs=FAMILIES['pvt_tiny'], fpn_channels=16, channels=8)
    convs = [sum(isinstance(m, segmentation.models.ConvNormAct) for m in h) for h in fpn.decode_head.scale_heads]
    ups = [sum(isinstance(m, nn.Upsample) for m in h) for h in fpn.decode_head.scale_heads]
    assert (convs, ups) == ([1, 1, 2, 3], [0, 1, 2, 3])
    assert fpn.decode_head.scale_heads[0][0][1].num_groups == 2  # 8 channels: 4 a group
    assert segmentation.models.ConvNormAct(4, 128, norm='gn')[1].num_groups == 32  # Panoptic FPN's 128 channels
    uper = segmentation.upernet('cvt_ls_13', 5, model_kwargs=FAMILIES['cvt_ls_13'], channels=8)
    assert len(uper.decode_head.ppm) == 4 and len(uper.decode_head.lateral_convs) == 2
    assert isinstance(uper.decode_head.bottleneck[1], nn.BatchNorm2d)
    assert uper.decode_head.bottleneck[0].in_channels == 64 + 4 * 8  # the last level and four pooled maps


def test_loss_ignores_and_never_divides_by_zero():
    logits = torch.randn(1, 3, 4, 4, requires_grad=True)
    y = torch.randint(0, 3, (1, 4, 4))
    y[0, 0] = 255
    expected = nn.functional.cross_entropy(logits, y, ignore_index=255)  # torch's mean over the labelled pixels
    assert torch.allclose(segmentation.segmentation_loss(logits, y), expected)
    empty = segmentation.segmentation_loss(logits, torch.full((1, 4, 4), 255))
    assert empty.item() == 0 and empty.requires_grad


# --- metric


def test_metric_hand_computed():
    """Image 1 (labels / predictions, 255 = ignored): class 0: I 1, U 3; class 1: I 2, U 3; class 2: I 0, U 1
    (the 2 predicted on the ignored pixel is not counted); class 3: nowhere (left out of every mean). Image 2 adds
    a class-1 pixel predicted as 3: class 3 then has IoU 0 (in mIoU) and no accuracy (not in mAcc); class 1 I 2, U 4.
    The split's numbers come from the summed areas, not from per-image means."""
    label1, pred1 = torch.tensor([[0, 0, 1], [1, 2, 255]]), torch.tensor([[0, 1, 1], [1, 0, 2]])
    metric = SegmentationMetric(4, class_names=['a', 'b', 'c', 'd'])
    metric.update(pred1, label1)
    r = metric.result()
    assert r['IoU'][:3] == pytest.approx([1 / 3, 2 / 3, 0]) and math.isnan(r['IoU'][3])
    assert r['Acc'][:3] == pytest.approx([1 / 2, 1, 0]) and math.isnan(r['Acc'][3])
    assert (r['mIoU'], r['mAcc'], r['aAcc']) == pytest.approx((1 / 3, 1 / 2, 3 / 5))
    assert (r['pixels'], r['classes_scored'], r['images'], r['classes']) == (5, 3, 1, ['a', 'b', 'c', 'd'])
    metric.update(torch.tensor([[3]]), torch.tensor([[1]]))
    r = metric.result()
    assert r['IoU'] == pytest.approx([1 / 3, 1 / 2, 0, 0]) and math.isnan(r['Acc'][3])
    assert (r['mIoU'], r['mAcc'], r['aAcc']) == pytest.approx((5 / 24, 7 / 18, 1 / 2))
    areas = intersect_and_union(pred1, label1, 4)
    assert [areas[k].tolist() for k in ('intersect', 'union', 'pred_area', 'label_area')] == [
        [1, 2, 0, 0], [3, 3, 1, 0], [2, 3, 0, 0], [2, 2, 1, 0]]


def _histc_areas(pred, label, num_classes, ignore_index=255):
    """mmsegmentation's intersect_and_union, as it is written (torch.histc over the kept pixels)."""
    mask = label != ignore_index
    pred, label = pred[mask], label[mask]
    intersect = pred[pred == label]
    hist = [torch.histc(t.float(), bins=num_classes, min=0, max=num_classes - 1) for t in (intersect, pred, label)]
    return hist[0], hist[1] + hist[2] - hist[0], hist[2]


def test_metric_equals_mmsegmentations_areas_and_merges_like_one_split():
    g = torch.Generator().manual_seed(0)
    labels = [torch.randint(0, 6, (2, 9, 11), generator=g) for _ in range(3)]
    preds = [torch.randint(0, 6, (2, 9, 11), generator=g) for _ in range(3)]
    for lab in labels:
        lab[lab == 5] = 255  # class 5 only ever predicted
    parts, whole = [], SegmentationMetric(6)
    inter, union, area = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    for p, lab in zip(preds, labels):
        part = SegmentationMetric(6)
        part.update(p, lab)
        parts.append(part)
        whole.update(p, lab)
        i, u, a = _histc_areas(p, lab, 6)
        inter, union, area = inter + i, union + u, area + a
    expected = metrics_from_areas(inter, union, area)
    merged = SegmentationMetric(6).merge(parts)
    assert torch.equal(merged.matrix, whole.matrix)  # three "processes" summed: the split's counts, exactly
    merged = merged.result()
    for key in ('aAcc', 'mIoU', 'mAcc'):
        assert merged[key] == pytest.approx(expected[key])
    assert np.allclose(merged['IoU'], expected['IoU'], equal_nan=True)
    assert merged['images'] == 6


def test_metric_errors():
    metric = SegmentationMetric(3)
    with pytest.raises(ValueError, match='label values \\[7\\] are outside the 3 classes'):
        metric.update(torch.tensor([0, 1]), torch.tensor([7, 1]))
    with pytest.raises(ValueError, match='shape'):
        metric.update(torch.tensor([0, 1]), torch.tensor([[0, 1]]))


# --- inference


def test_slide_equals_whole_where_the_window_covers_the_image():
    torch.manual_seed(0)
    model = segmentation.upernet('cvt_ls_13', 4, model_kwargs=FAMILIES['cvt_ls_13'], channels=8).eval()
    x = torch.randn(1, 3, 37, 45)
    with torch.no_grad():
        whole = predict(model, x, 'whole')
        for crop in ((37, 45), (64, 64), (40, 80)):
            assert torch.equal(predict(model, x, 'slide', crop, (16, 16)), whole)
        resized = predict(model, x, 'slide', (64, 64), (32, 32), out_size=(50, 60))
    assert resized.shape == (1, 4, 50, 60)


def test_slide_windows_average_where_they_overlap():
    """A per-pixel model gives the same logits in any window: the averaged windows equal the whole image (within
    float rounding) for windows smaller than the image, overlapping or not."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 5, 1)
    x = torch.randn(2, 3, 23, 30)
    with torch.no_grad():
        whole = model(x)
        for crop, stride in (((8, 8), (5, 5)), ((10, 12), (10, 12)), ((23, 7), (3, 4))):
            assert torch.allclose(slide_inference(model, x, crop, stride), whole, atol=1e-6)
    with pytest.raises(ValueError, match='positive'):
        slide_inference(model, x, (8, 8), (0, 4))


# --- data


def _png(path, array, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, dtype=np.uint8), mode).save(path)


def _image(path, h=12, w=16):
    rng = np.random.RandomState(len(str(path)))
    _png(path, rng.randint(0, 255, (h, w, 3)))


def test_folder_errors_name_each_file(tmp_path):
    images, masks = tmp_path / 'images', tmp_path / 'masks'
    for name in ('good', 'nomask', 'small', 'label', 'broken', 'rgb'):
        _image(images / f'{name}.png')
    (images / 'broken.png').write_bytes(b'not an image')
    _png(masks / 'good.png', np.full((12, 16), 2))
    _png(masks / 'small.png', np.zeros((10, 16)))
    _png(masks / 'label.png', np.array([[1, 3, 255] + [0] * 13] * 12))
    _png(masks / 'broken.png', np.zeros((12, 16)))
    _png(masks / 'rgb.png', np.zeros((12, 16, 3)))
    pairs = folder_pairs(str(images), str(masks))
    with pytest.raises(SegmentationDataError) as e:
        SegmentationDataset(pairs, ['a', 'b', 'c'])
    message = str(e.value)
    for kind, name in (('missing mask', 'nomask'), ('size mismatch', 'small'), ('bad label', 'label'),
                       ('unreadable image', 'broken'), ('unreadable mask', 'rgb')):
        assert f'{kind}: {images / name}.png' in message
    assert 'values [3]' in message and '--skip-bad-images' in message and '5 bad image(s)' in message
    kept = SegmentationDataset(pairs, ['a', 'b', 'c'], skip_bad=True)
    assert len(kept) == 1 and len(kept.left_out) == 5 and len(kept.problems) == 5
    image, label = kept[0]
    assert image.shape == (3, 12, 16) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and label.unique().tolist() == [2]
    with pytest.raises(SegmentationDataError, match='mask folder not found'):
        folder_pairs(str(images), str(tmp_path / 'nowhere'))


def test_ade20k_reduce_zero_label_and_cityscapes_layout(tmp_path):
    ade = tmp_path / 'ade'
    _image(ade / 'images' / 'training' / 'a.jpg')
    _png(ade / 'annotations' / 'training' / 'a.png', np.array([[0, 1, 150, 255] * 4] * 12))
    data = SegmentationDataset(ade20k_pairs(str(ade), 'training'), segmentation.data.ADE20K_CLASSES,
                               reduce_zero_label=True)
    assert data.num_classes == 150
    assert data[0][1][0, :4].tolist() == [255, 0, 149, 255]
    _png(ade / 'annotations' / 'training' / 'a.png', np.array([[0, 151] * 8] * 12))
    with pytest.raises(SegmentationDataError, match=r'values \[151\].*read as value - 1 with 0 ignored'):
        SegmentationDataset(ade20k_pairs(str(ade), 'training'), segmentation.data.ADE20K_CLASSES, True)
    city = tmp_path / 'city'
    _image(city / 'leftImg8bit' / 'val' / 'bonn' / 'bonn_000000_000019_leftImg8bit.png')
    mask = city / 'gtFine' / 'val' / 'bonn' / 'bonn_000000_000019_gtFine_labelTrainIds.png'
    _png(mask, np.array([[18, 255, 0, 3] * 4] * 12))
    pairs = cityscapes_pairs(str(city), 'val')
    assert pairs == [(str(city / 'leftImg8bit' / 'val' / 'bonn' / 'bonn_000000_000019_leftImg8bit.png'), str(mask))]
    assert SegmentationDataset(pairs, segmentation.data.CITYSCAPES_CLASSES)[0][1][0, :4].tolist() == [18, 255, 0, 3]


def test_train_pipeline(tmp_path):
    """Every sample has the crop size (a smaller image padded: label 255, image 0); the same (seed, epoch, index)
    gives the same sample, another epoch another one; the test scale keeps the aspect ratio (mmcv's rounding)."""
    _image(tmp_path / 'i' / 'x.png', 30, 40)
    _png(tmp_path / 'm' / 'x.png', np.indices((30, 40))[1] // 10)  # four vertical bands, classes 0..3
    pipeline = TrainPipeline(scale=(40, 30), ratio_range=(0.5, 2.0), crop_size=(32, 32))
    data = SegmentationDataset(folder_pairs(str(tmp_path / 'i'), str(tmp_path / 'm')), 'abcd', pipeline=pipeline,
                               seed=3)
    samples = []
    for epoch in range(6):
        data.set_epoch(epoch)
        samples.append(data[0])
    data.set_epoch(0)
    again = data[0]
    assert torch.equal(again[0], samples[0][0]) and torch.equal(again[1], samples[0][1])
    assert all(s[0].shape == (3, 32, 32) and s[1].shape == (32, 32) for s in samples)
    assert any(not torch.equal(s[1], samples[0][1]) for s in samples[1:])
    for image, label in samples:
        rows = (label != 255).any(1).sum()
        cols = (label != 255).any(0).sum()
        assert (image[:, rows:] == 0).all() and (image[:, :, cols:] == 0).all()
        kept = label[label != 255]
        assert kept.numel() and kept.max() <= 3
    assert rescale_size((512, 683), (2048, 512)) == (512, 683)
    assert rescale_size((1024, 2048), (2048, 512)) == (512, 1024)
    assert rescale_size((30, 40), (40, 30), 0.5) == (15, 20)
    evaluation = SegmentationDataset(data.pairs, 'abcd', test_scale=(20, 15))
    image, label = evaluation[0]
    assert image.shape == (3, 15, 20) and label.shape == (30, 40)
