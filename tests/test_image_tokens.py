"""`mm_oval.image_tokens`: the one definition of an image's token count and patch grid that the chat's
figures and the trainers' traces use."""

from types import SimpleNamespace

import pytest
import torch

from mm_oval.errors import ModelError
from mm_oval.image_tokens import grid_coords, grid_shape, tokens_per_image


def test_the_count_comes_from_the_vision_tower_or_the_config():
    llava = SimpleNamespace(
        vision_config=SimpleNamespace(image_size=336, patch_size=14), image_seq_length=576
    )
    assert tokens_per_image(llava) == 576
    full = SimpleNamespace(
        vision_config=SimpleNamespace(image_size=336, patch_size=14), vision_feature_select_strategy="full"
    )
    assert tokens_per_image(full) == 577
    assert tokens_per_image(SimpleNamespace(image_seq_length=64)) == 64
    assert tokens_per_image(SimpleNamespace(), default=9) == 9
    with pytest.raises(ModelError, match="how many tokens"):
        tokens_per_image(SimpleNamespace())


def test_two_images_are_laid_out_row_major_on_their_own_grids():
    assert grid_shape(576) == (24, 24) and grid_shape(6) == (1, 6)
    img = 7
    ids = torch.tensor([1, img, img, img, img, 2, img, img, img, img, 3])
    rc = grid_coords(ids, img, 4)
    assert rc[[0, 5, 10]].eq(-1).all()
    assert rc[1:5].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert rc[6:10].tolist() == [[1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
