"""COCO-format reading (lsvision.detection.data) and the generated shapes dataset (lsvision.data.coco_shapes).

`write_tiny_coco` builds a small hand-made COCO split whose targets are known pixel by pixel; the other detection
test files use it too.
"""
import json
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from lsvision.data.coco_shapes import SHAPE_CLASSES, generate_coco_shapes
from lsvision.detection.data import CocoDataError, CocoInstances, collate_detection, describe_degenerate_box

H, W = 24, 32


def _rect(h: int, w: int, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
    mask = np.zeros((h, w), np.uint8)
    mask[y0:y1, x0:x1] = 1
    return mask


def _uncompressed(mask: np.ndarray) -> Dict[str, Any]:
    """COCO's uncompressed RLE (column-major runs, starting with zeros), written out by hand."""
    flat = mask.flatten(order='F').tolist()
    counts, value, run = [], 0, 0
    for v in flat:
        if v != value:
            counts.append(run)
            value, run = v, 0
        run += 1
    counts.append(run)
    return {'size': list(mask.shape), 'counts': counts}


def tiny_coco_dict() -> Dict[str, Any]:
    """Three images (category ids 3 and 7 -> labels 1 and 2): image 1 a polygon square, an uncompressed-RLE box and a
    crowd region; image 2 a compressed-RLE box and a degenerate box; image 3 nothing."""
    compressed = mask_utils.encode(np.asfortranarray(_rect(H, W, 2, 10, 20, 30)))
    images = [dict(id=i, file_name=f'{i}.png', height=H, width=W) for i in (1, 2, 3)]
    annotations = [
        # the square's polygon rasterizes to rows 3-7, columns 2-5 (pycocotools' pixel convention)
        dict(id=1, image_id=1, category_id=7, bbox=[2, 3, 4, 5], area=20.0, iscrowd=0,
             segmentation=[[2, 3, 6, 3, 6, 8, 2, 8]]),
        dict(id=2, image_id=1, category_id=3, bbox=[10, 12, 8, 6], area=48.0, iscrowd=0,
             segmentation=_uncompressed(_rect(H, W, 12, 18, 10, 18))),
        dict(id=3, image_id=1, category_id=3, bbox=[20, 0, 12, 8], area=96.0, iscrowd=1,
             segmentation=_uncompressed(_rect(H, W, 0, 8, 20, 32))),
        dict(id=4, image_id=2, category_id=3, bbox=[20, 2, 10, 8], area=80.0, iscrowd=0,
             segmentation={'size': [H, W], 'counts': compressed['counts'].decode('ascii')}),
        dict(id=5, image_id=2, category_id=7, bbox=[5, 5, 0, 4], area=0.0, iscrowd=0,
             segmentation=[[5, 5, 5, 9, 5.5, 7]]),
    ]
    categories = [dict(id=7, name='seven'), dict(id=3, name='three')]
    return dict(images=images, annotations=annotations, categories=categories)


def write_tiny_coco(root: Path, data: Optional[Dict[str, Any]] = None, sizes: Optional[Dict[int, tuple]] = None
                    ) -> Path:
    """Writes `data` (default `tiny_coco_dict()`) as root/instances.json and its PNG images under root/images;
    `sizes` overrides an image's written (width, height). Returns the annotation file."""
    data = data or tiny_coco_dict()
    (root / 'images').mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    for image in data['images']:
        width, height = (sizes or {}).get(image['id'], (image['width'], image['height']))
        Image.fromarray(rng.randint(0, 255, (height, width, 3), dtype=np.uint8)).save(
            root / 'images' / image['file_name'])
    path = root / 'instances.json'
    path.write_text(json.dumps(data))
    return path


def _dataset(root: Path, data: Optional[Dict[str, Any]] = None, **kwargs: Any) -> CocoInstances:
    return CocoInstances(str(write_tiny_coco(root, data)), str(root / 'images'), **kwargs)


def test_reads_targets_as_torchvision_wants(tmp_path):
    ds = _dataset(tmp_path)
    assert ds.class_names == ['three', 'seven'] and ds.num_classes == 3  # ids 3, 7 -> labels 1, 2
    assert ds.image_ids == [1, 2, 3]
    image, target = ds[0]
    assert image.shape == (3, H, W) and image.dtype == torch.float32 and 0 <= image.min() and image.max() <= 1
    expected = np.asarray(Image.open(tmp_path / 'images' / '1.png'), dtype=np.float32) / 255
    torch.testing.assert_close(image, torch.from_numpy(expected).permute(2, 0, 1))
    assert target['image_id'] == 1
    # the crowd region is no training target
    torch.testing.assert_close(target['boxes'], torch.tensor([[2., 3., 6., 8.], [10., 12., 18., 18.]]))
    assert target['labels'].tolist() == [2, 1]
    assert target['masks'].dtype == torch.uint8 and target['masks'].shape == (2, H, W)
    assert torch.equal(target['masks'][0], torch.from_numpy(_rect(H, W, 3, 8, 2, 6)))  # polygon
    assert torch.equal(target['masks'][1], torch.from_numpy(_rect(H, W, 12, 18, 10, 18)))  # uncompressed RLE
    _, target = ds[1]  # compressed RLE; the degenerate box (no width) is no target
    assert target['labels'].tolist() == [1]
    assert torch.equal(target['masks'][0], torch.from_numpy(_rect(H, W, 2, 10, 20, 30)))
    _, target = ds[2]  # no annotations: a negative image, shaped as torchvision's detectors accept it
    assert target['boxes'].shape == (0, 4) and target['labels'].shape == (0,) and target['masks'].shape == (0, H, W)
    assert (ds.stats.crowd, ds.stats.degenerate_boxes, ds.stats.empty_images, ds.stats.annotations) == (1, 1, 1, 5)
    images, targets = collate_detection([ds[0], ds[2]])
    assert len(images) == 2 and [t['image_id'] for t in targets] == [1, 3]


def test_degenerate_boxes_are_named(tmp_path):
    """A box wholly outside its image (image 3's only object) is counted and named with the zero-width one: image,
    annotation id, the box as the file gives it, and why."""
    data = tiny_coco_dict()
    data['annotations'].append(dict(id=9, image_id=3, category_id=7, bbox=[W + 4, 2, 6, 6], area=36.0, iscrowd=0,
                                    segmentation=[[W + 4, 2, W + 10, 2, W + 10, 8]]))
    ds = _dataset(tmp_path, data)
    assert (ds.stats.degenerate_boxes, ds.stats.empty_images) == (2, 1)  # image 3 still has no target
    assert [describe_degenerate_box(e) for e in ds.stats.degenerate_examples] == [
        'image 2 (2.png), annotation 5: bbox [5, 5, 0, 4] has no width or height',
        f'image 3 (3.png), annotation 9: bbox [{W + 4}, 2, 6, 6] lies wholly outside the {W}x{H} image']


def test_training_flips_are_seeded_and_consistent(tmp_path):
    ds = _dataset(tmp_path, train=True, seed=3)
    plain = _dataset(tmp_path / 'plain')
    flips = []
    for epoch in range(6):
        ds.set_epoch(epoch)
        image, target = ds[0]
        flipped = not torch.equal(image, plain[0][0])
        flips.append(flipped)
        if flipped:
            assert torch.equal(image, plain[0][0].flip(-1))
            assert torch.equal(target['masks'], plain[0][1]['masks'].flip(-1))
            torch.testing.assert_close(target['boxes'], torch.tensor([[26., 3., 30., 8.], [14., 12., 22., 18.]]))
        again = ds[0]
        assert torch.equal(again[0], image)  # the same (seed, epoch, index): the same flip
    assert any(flips) and not all(flips)


def test_empty_images_dropped_only_when_asked(tmp_path):
    write_tiny_coco(tmp_path)
    ann, images = str(tmp_path / 'instances.json'), str(tmp_path / 'images')
    assert CocoInstances(ann, images, train=True).image_ids == [1, 2, 3]
    dropped = CocoInstances(ann, images, train=True, drop_empty=True)
    assert dropped.image_ids == [1, 2] and dropped.stats.dropped_empty_images == 1
    assert CocoInstances(ann, images, drop_empty=True).image_ids == [1, 2, 3]  # evaluation keeps them


def _with(change) -> Dict[str, Any]:
    data = tiny_coco_dict()
    change(data)
    return data


def _ann(data: Dict[str, Any], ann_id: int) -> Dict[str, Any]:
    return next(a for a in data['annotations'] if a['id'] == ann_id)


BAD_ANNOTATIONS = {
    'malformed polygon': lambda d: _ann(d, 1).update(segmentation=[[2, 3, 6, 3, 6]]),
    'malformed RLE': lambda d: _ann(d, 2)['segmentation'].update(counts=[5, 3]),
    'malformed bbox': lambda d: _ann(d, 1).update(bbox=[2, 3, 4]),
    'unknown category': lambda d: _ann(d, 1).update(category_id=99),
}


@pytest.mark.parametrize('kind', sorted(BAD_ANNOTATIONS))
def test_bad_annotations_are_named_then_skipped(tmp_path, kind):
    data = _with(BAD_ANNOTATIONS[kind])
    with pytest.raises(CocoDataError) as e:
        _dataset(tmp_path, data)
    message = str(e.value)
    assert f'1 {kind}' in message and 'image 1 (1.png)' in message and '--skip-bad-images' in message
    ds = _dataset(tmp_path, data, skip_bad=True)  # the hint, followed
    assert ds.image_ids == [2, 3] and ds.stats.left_out_images == [1]
    assert [p.kind for p in ds.problems] == [kind]


def test_corrupt_compressed_rle_is_named(tmp_path):
    data = _with(lambda d: _ann(d, 4)['segmentation'].update(counts='zzzz'))
    with pytest.raises(CocoDataError, match=r'malformed RLE: image 2 \(2.png\): annotation 4'):
        _dataset(tmp_path, data)
    data = _with(lambda d: _ann(d, 4)['segmentation'].update(size=[H, W + 1]))
    with pytest.raises(CocoDataError, match='is not the image'):
        _dataset(tmp_path, data)


def test_bad_image_files_are_named_then_skipped(tmp_path):
    ann = write_tiny_coco(tmp_path, sizes={2: (W + 1, H)})
    (tmp_path / 'images' / '1.png').write_text('not an image')
    data = json.loads(ann.read_text())
    data['images'].append(dict(id=4, file_name='4.png', height=H, width=W))
    ann.write_text(json.dumps(data))
    with pytest.raises(CocoDataError) as e:
        CocoInstances(str(ann), str(tmp_path / 'images'))
    message = str(e.value)
    for text in ('3 problem(s) in 3 image(s)', 'unreadable image: image 1 (1.png)',
                 'size mismatch: image 2 (2.png): the file is 33 x 24', 'missing image: image 4 (4.png)'):
        assert text in message
    ds = CocoInstances(str(ann), str(tmp_path / 'images'), skip_bad=True)
    assert ds.image_ids == [3] and ds.stats.left_out_images == [1, 2, 4]
    del data['images'][2]['height']
    ann.write_text(json.dumps(data))
    with pytest.raises(CocoDataError, match=r'malformed image entry: image 3 \(3.png\): no height in its entry'):
        CocoInstances(str(ann), str(tmp_path / 'images'))


def test_missing_files_and_class_count(tmp_path):
    with pytest.raises(CocoDataError, match='annotation file not found'):
        CocoInstances(str(tmp_path / 'nope.json'), str(tmp_path))
    with pytest.raises(CocoDataError, match='image folder not found'):
        CocoInstances(str(tmp_path / 'nope.json'), str(tmp_path / 'nope'))
    (tmp_path / 'bad.json').write_text('[1, 2]')
    with pytest.raises(CocoDataError, match='is not a COCO instances file'):
        CocoInstances(str(tmp_path / 'bad.json'), str(tmp_path))
    ds = _dataset(tmp_path)
    with pytest.raises(CocoDataError, match='num_classes 3 .background included., not 81: pass --num-classes 3'):
        ds.check_num_classes(81)
    ds.check_num_classes(3)  # the hint, followed


def test_coco_shapes_masks_are_the_drawing(tmp_path):
    paths = generate_coco_shapes(str(tmp_path / 'shapes'), num_train=4, num_val=6, image_size=(64, 80),
                                 object_sizes=(12, 30), seed=1)
    again = generate_coco_shapes(str(tmp_path / 'again'), num_train=4, num_val=6, image_size=(64, 80),
                                 object_sizes=(12, 30), seed=1)
    assert Path(paths['val_annotations']).read_text() == Path(again['val_annotations']).read_text()
    ds = CocoInstances(paths['val_annotations'], paths['val_images'])
    assert ds.class_names == list(SHAPE_CLASSES) and not ds.problems and ds.stats.annotations > 0
    kinds = set()
    for index in range(len(ds)):
        image, target = ds[index]
        pixels = (image * 255).round().to(torch.uint8)
        anns = ds.coco.imgToAnns[ds.image_ids[index]]
        kinds |= {type(a['segmentation']).__name__ for a in anns}
        for mask, box, ann in zip(target['masks'], target['boxes'], anns):
            inside = pixels[:, mask.bool()]
            assert (inside == inside[:, :1]).all()  # lossless PNG: one colour, exactly on the mask
            ys, xs = torch.nonzero(mask, as_tuple=True)
            assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            assert ann['area'] == mask.sum()
    assert kinds == {'list', 'dict'}  # polygons and compressed RLE
    assert sorted(p.name for p in Path(paths['train_images']).iterdir())[0].endswith('.jpg')
