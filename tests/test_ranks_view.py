"""The ranks view (widgets/ranks_view.py): a click on a rank filters the tree and highlights its chunks."""

from __future__ import annotations

from gui_support import leaf_paths, no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)


def test_rank_click_filters_tree_and_highlights(qtbot, fixtures):
    view = open_view(qtbot, fixtures["ddp_r2"])
    before = set(leaf_paths(view.proxy))
    view.ranks.select_rank(1)
    after = set(leaf_paths(view.proxy))
    ck = view.data.ckpt
    expected = {t.fqn for t in ck.tensors if 1 in t.ranks} | {o.fqn for o in ck.objects if o.rank == 1}
    assert after == expected and after < before
    view.ranks.select_rank(None)
    assert set(leaf_paths(view.proxy)) == before
