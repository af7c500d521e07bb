"""Progress bars a user reads: a group run's bar counts groups, a sweep's pass counts its own work (not the
grids before it), lm-eval's request types share one bar, and datasets' per-split bars are off."""

from __future__ import annotations

from driver.lm.progress import Progress


def test_a_group_runs_bar_says_groups(capsys):
    bar = Progress(["g0@a+b", "g1@c+d"], unit="group")
    bar.expect(4, 0, "loglikelihood")
    bar.advance(0, 4)
    assert bar.bar.desc == "loglikelihood on 2 groups"
    bar.close()
    one = Progress(["w0@a"])
    one.expect(1, 0, "generate")
    assert one.bar.desc == "generate on 1 worker"
    one.close()


def test_each_grid_counts_its_own_work_and_lm_evals_types_share_a_bar(capsys):
    bar = Progress(["w0@a"])
    bar.expect(10, 0, "loglikelihood grid of 5 configurations")
    bar.advance(0, 10)
    bar.expect(3, 1, "loglikelihood grid of 1 configuration")  # the fluency pass
    assert (bar.total, bar.bar.total, bar.cached) == (2, 2, 1)
    bar.close()
    bar.expect(4, 0, "loglikelihood")
    bar.advance(0, 4)
    bar.expect(2, 0, "generate")  # lm-eval's next type: the same bar grows
    assert bar.bar.total == 6
    bar.close()


def test_a_grid_that_comes_while_work_is_left_joins_it(capsys):
    bar = Progress(["w0@a"])
    bar.expect(10, 0, "generate grid of 5 configurations")
    bar.expect(3, 0, "generate grid of 1 configuration")  # nothing is done yet: one bar, nothing lost from view
    assert bar.bar.total == 13
    bar.close()


def test_datasets_split_bars_are_off():
    import datasets

    from driver.lm import quiet

    datasets.enable_progress_bars()
    quiet.install()
    assert not datasets.is_progress_bar_enabled()


def test_a_missing_datasets_hint_fits_the_case(monkeypatch):
    from driver.lm.evaluation import dataset_hint

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    arc = dataset_hint("Couldn't reach 'allenai/ai2_arc' on the Hub (offline mode is enabled)")
    assert "mmlu" not in arc and arc.endswith("or allow downloads (unset HF_DATASETS_OFFLINE)")  # only the one set
    assert "cais___mmlu" in dataset_hint("Couldn't reach 'cais/mmlu' on the Hub")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    assert dataset_hint("x").endswith("or let this machine reach the Hugging Face Hub (it could not)")
