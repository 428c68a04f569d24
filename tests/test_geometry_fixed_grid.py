"""`mm_oval.geometry`'s layout of an image when only its token count is known (LLaVA-1.5's one square grid
per image): the grid the chat's maps, the KVP grid feature and the cache without a Geometry use."""

import torch

from mm_oval.geometry import fixed_grid_rc, grid_shape


def test_a_square_count_is_a_square_grid_and_any_other_one_row():
    assert grid_shape(576) == (24, 24) and grid_shape(64) == (8, 8) and grid_shape(6) == (1, 6)


def test_two_images_are_laid_out_row_major_on_their_own_grids():
    img = 7
    ids = torch.tensor([[1, img, img, img, img, 2, img, img, img, img, 3]])
    rc = fixed_grid_rc(ids == img, 4)[0]
    assert rc[[0, 5, 10]].eq(-1).all()
    assert rc[1:5].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert rc[6:10].tolist() == [[1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
