import torch

from nmt_cli.engine.figures import Figures


def test_late_figures_keep_the_newest_window_until_asked_to_wait():
    figures = Figures(late=True)
    for step in range(1, 4):
        figures.add(torch.tensor([float(step), 0.0]))
    figures.close(last_step=3, epoch=0, seconds=1.0)
    assert figures.ready(wait=False) == []  # the only window is the newest
    figures.add(torch.tensor([4.0, 1.0]))
    figures.close(last_step=4, epoch=1, seconds=0.5)
    figures.close(last_step=4, epoch=1, seconds=0.0)  # nothing added: no window
    ((window, rows),) = figures.ready(wait=False)
    assert (window.last_step, window.epoch, window.seconds) == (3, 0, 1.0)
    assert rows == [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]
    ((window, rows),) = figures.ready(wait=True)
    assert (window.last_step, rows) == (4, [[4.0, 1.0]])
    assert figures.ready(wait=True) == []


def test_figures_read_at_once_where_nothing_is_queued():
    figures = Figures(late=False)
    figures.add(torch.tensor([1.0]))
    figures.close(last_step=1, epoch=0, seconds=1.0)
    assert [rows for _, rows in figures.ready(wait=False)] == [[[1.0]]]
