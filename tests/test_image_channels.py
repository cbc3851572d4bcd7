"""A model of other than 3 input channels on a folder of RGB images: training and evaluation read the images in the
model's channels when nothing says otherwise (timm's rule: grayscale 'L' for 1 channel), normalise with the model's
RGB mean/std averaged to one value (recorded in the run, so evaluation normalises as training did), and a mode or a
channel count that cannot work is an error that says what to change (following it works)."""
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from _helpers import load_tool, write_two_class_images
from test_train import TINY_MODEL

from lsvision.runs import model_input_channels, normalization_for_channels
from lsvision.train import TrainSetupError, parse_args, run

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_SIZE = TINY_MODEL.index('--input-size')
TINY_KWARGS = TINY_MODEL[_SIZE + 4:TINY_MODEL.index('--mean')]  # --model-kwargs ...: the tiny CvT-LS of test_train


def _train(root: Path, *extra: str) -> dict:
    return run(parse_args([str(root), '--output', str(root.parent / 'out'), '--experiment', 'run',
                           '--model', 'cvt_ls_13', '--num-classes', '2', '--img-size', '16', *TINY_KWARGS,
                           '--epochs', '1', '-b', '4', '-j', '0', *extra]))


def test_normalization_for_channels():
    assert normalization_for_channels(IMAGENET_MEAN, IMAGENET_STD, 3) is None
    mean, std = normalization_for_channels(IMAGENET_MEAN, IMAGENET_STD, 1)
    assert mean == [pytest.approx(sum(IMAGENET_MEAN) / 3)] and std == [pytest.approx(sum(IMAGENET_STD) / 3)]
    with pytest.raises(ValueError, match='takes 4 input channels but the normalisation has 3 mean.*--mean and --std'):
        normalization_for_channels(IMAGENET_MEAN, IMAGENET_STD, 4)


def test_a_one_channel_model_trains_on_rgb_images_and_validate_scores_it_as_training_did(tmp_path):
    write_two_class_images(tmp_path / 'data', per_class=4)
    result = _train(tmp_path / 'data', '--in-chans', '1')  # no --input-img-mode, no --mean/--std
    assert result['epochs_done'] == 1 and math.isfinite(result['top1'])
    args = yaml.safe_load((tmp_path / 'out' / 'run' / 'args.yaml').read_text())
    assert args['input_img_mode'] == 'L'
    assert args['mean'] == [pytest.approx(sum(IMAGENET_MEAN) / 3)] and args['std'] == [pytest.approx(0.226)]
    out = tmp_path / 'val'
    assert load_tool('validate').main(['--data-dir', str(tmp_path / 'data' / 'val'), '--model', 'cvt_ls_13',
                                       '--checkpoint', result['last_checkpoint'], '--workers', '0', '--no-progress',
                                       '--out-dir', str(out)]) == 0
    scored = json.loads((out / 'results.json').read_text())['models'][0]
    assert scored['input_img_mode'] == 'L'
    assert scored['suites']['folder']['top1'] == pytest.approx(result['model_metrics']['top1'], abs=1e-9)


def test_a_mode_of_other_channels_is_refused_and_leaving_it_out_trains(tmp_path):
    write_two_class_images(tmp_path / 'data', per_class=4)
    with pytest.raises(TrainSetupError) as e:
        _train(tmp_path / 'data', '--in-chans', '1', '--input-img-mode', 'RGB')
    assert ('--input-img-mode RGB reads images as 3 channel(s), but the model takes 1 (--in-chans / --input-size): '
            'leave --input-img-mode out or set --in-chans 3') in str(e.value)
    with pytest.raises(TrainSetupError) as e:
        _train(tmp_path / 'data', '--in-chans', '1', '--mean', '0.5', '0.5', '0.5', '--std', '0.5')
    assert ('--mean has 3 values but the model takes 1 input channel(s) (--in-chans / --input-size): give 1 value(s), '
            'or one for every channel') in str(e.value)
    with pytest.raises(TrainSetupError, match="'rgb' is not a PIL image mode"):
        _train(tmp_path / 'data', '--input-img-mode', 'rgb')
    with pytest.raises(TrainSetupError, match='no image file reads as 2 channels.*or give --input-img-mode'):
        _train(tmp_path / 'data', '--in-chans', '2')
    assert not (tmp_path / 'out').exists()  # all refused before anything is written
    assert _train(tmp_path / 'data', '--in-chans', '1')['epochs_done'] == 1  # the first hint, followed
    shutil.rmtree(tmp_path / 'out')
    assert _train(tmp_path / 'data', '--in-chans', '1', '--mean', '0.5', '--std', '0.5')['epochs_done'] == 1
    shutil.rmtree(tmp_path / 'out')
    assert _train(tmp_path / 'data', '--in-chans', '3', '--input-img-mode', 'RGB')['epochs_done'] == 1  # the second


@pytest.mark.parametrize('tool', ['validate', 'robustness'])
def test_eval_tools_read_images_in_the_channels_of_a_model_built_with_in_chans(tool, tmp_path, capsys):
    write_two_class_images(tmp_path / 'data', per_class=1)
    (tmp_path / 'classes.txt').write_text('class0\nclass1\n')
    suite = (['--data-dir', str(tmp_path / 'data' / 'val'), '--class-map', str(tmp_path / 'classes.txt')]
             if tool == 'validate' else ['--imagenet-a', str(_imagenet_a(tmp_path))])
    common = [*suite, '--model', 'cvt_ls_13', '--img-size', '32', '--workers', '0', '--no-progress']
    out = tmp_path / 'o'
    tiny = ['embed_dims=(16,32,32)', 'num_heads=(1,1,1)', 'depths=(1,1,1)', *(['num_classes=2'] * (tool == 'validate'))]
    assert load_tool(tool).main([*common, '--model-kwargs', 'in_chans=1', *tiny, '--out-dir', str(out)]) == 0
    result = json.loads((out / 'results.json').read_text())['models'][0]
    suite_result = next(iter(result['suites'].values()))
    assert result['input_img_mode'] == 'L' and suite_result['count'] > 0
    assert suite_result['protocol']['input_size'][0] == 1 and len(suite_result['protocol']['mean']) == 1
    assert load_tool(tool).main([*common, '--model-kwargs', 'in_chans=2', *tiny, '--out-dir', str(out)]) == 2
    assert 'no image file reads as 2 channels (1: grayscale L, 3: RGB, 4: RGBA)' in capsys.readouterr().err


def _imagenet_a(root: Path) -> Path:
    """Two ImageNet-A class folders (WordNet ids of the 200) of one RGB image each."""
    a = root / 'imagenet-a'
    for wnid, image in zip(('n01498041', 'n01531178'), sorted((root / 'data' / 'val').rglob('*.png'))):
        (a / wnid).mkdir(parents=True)
        shutil.copy(image, a / wnid / 'x.jpg')
    return a


def test_model_input_channels_of_each_family():
    import timm
    for name in ('cvt_ls_13', 'pvt_v2_b0_grc', 'swin_tiny_patch4_window7_224_grc', 'vit_small_patch16_224_grc'):
        assert model_input_channels(timm.create_model(name, in_chans=1, device='meta')) == 1, name
