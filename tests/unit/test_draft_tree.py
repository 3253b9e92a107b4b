"""A DFlash draft tree's shape (speculative.best_first_tree, DraftTree) and its verification's chains
(model.tree_chains)."""

import math

import pytest

from dflash.engine.model import tree_chains, tree_depths
from dflash.engine.speculative import DraftTree, best_first_tree

LOGPROBS = [[math.log(0.5), math.log(0.3), math.log(0.1)],
            [math.log(0.9), math.log(0.05), math.log(0.01)],
            [math.log(0.6), math.log(0.3), math.log(0.05)]]
IDS = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]


def shape(tree: DraftTree) -> tuple:
    return tree.tokens, tree.parents


def test_the_likeliest_paths_make_the_tree_first_choices_first():
    # paths by probability: 10 .5, 10-20 .45, 11 .3, 10-20-30 .27, 11-20 .27, 11-20-30 .162, 10-20-31 .135
    tree = best_first_tree(LOGPROBS, IDS, 7)
    assert shape(tree) == ((10, 20, 30, 31, 11, 20, 30), (0, 1, 2, 2, 0, 5, 6))
    assert tree.ranks == (0, 1, 3, 6, 2, 4, 5)
    assert tree.probabilities == pytest.approx((0.5, 0.45, 0.27, 0.135, 0.3, 0.27, 0.162))
    assert tree.expected() == pytest.approx(2.087)
    assert tree.chains() == 3 and tree.depth == 3 and tree.depths() == [1, 2, 3, 3, 1, 2, 3]
    assert shape(best_first_tree(LOGPROBS, IDS, 3)) == ((10, 20, 11), (0, 1, 0))
    assert shape(best_first_tree(LOGPROBS, IDS, 1)) == ((10,), (0,))
    assert len(best_first_tree(LOGPROBS, IDS, 0)) == 0


def test_the_rows_chosen_first_are_the_smaller_tree_itself():
    tree = best_first_tree(LOGPROBS, IDS, 7)
    for rows in range(1, 8):
        assert tree.first(rows) == best_first_tree(LOGPROBS, IDS, rows)
    assert tree.first(9) is tree


def test_a_confident_drafter_gets_a_chain():
    sure = [[0.0, -20.0]] * 4
    tree = best_first_tree(sure, [[1, 2], [3, 4], [5, 6], [7, 8]], 4)
    assert shape(tree) == ((1, 3, 5, 7), (0, 1, 2, 3))


def test_a_tree_cut_to_a_depth_keeps_its_rows_in_order():
    tree = best_first_tree(LOGPROBS, IDS, 7)
    assert shape(tree.within(1)) == ((10, 11), (0, 0))
    assert shape(tree.within(2)) == ((10, 20, 11, 20), (0, 1, 0, 3))
    assert tree.within(2).probabilities == pytest.approx((0.5, 0.45, 0.3, 0.27))
    assert tree.within(9) == tree


def test_chains_are_attended_last_first_each_on_its_paths_keys():
    parents = [-1, 0, 1, 2, 2, 0, 5, 6]  # the tree above with the pending token as row 0
    chains = tree_chains(parents)
    assert [(c.first, c.end, c.depth, c.path) for c in chains] == [
        (5, 8, 1, (0, 5, 6, 7)), (4, 5, 3, (0, 1, 2, 4)), (0, 4, 0, (0, 1, 2, 3))]
    assert tree_depths(parents) == [0, 1, 2, 3, 3, 1, 2, 3]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1]])
def test_a_malformed_tree_is_refused(parents):
    with pytest.raises(ValueError, match="parent"):
        tree_chains(parents)
