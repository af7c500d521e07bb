"""Progress bars off a terminal (issue 27, progress): lm-eval's context bars say whose contexts they count, and two
bars open at once (the tokenizer's beside the workers') write no cursor moves (`ESC[A`) into a log. datasets'
per-split bars are off (tests/test_ux_progress). Real tqdm and a real lm-eval task built from a local YAML."""

from __future__ import annotations

import io

import yaml

from driver.lm import quiet


def test_two_bars_at_once_write_no_cursor_moves_off_a_terminal():
    from tqdm import tqdm

    quiet.install()  # the CLI's entry point; pytest's stderr is no terminal
    out = io.StringIO()
    first = tqdm(total=4, desc="Tokenizing", file=out, mininterval=0)
    second = tqdm(total=4, desc="loglikelihood on 1 worker", file=out, mininterval=0)
    for _ in range(4):
        first.update(1)
        second.update(1)
    second.close()
    first.close()
    assert "\x1b[A" not in out.getvalue() and "Tokenizing" in out.getvalue()


def test_lm_evals_context_bar_names_its_task(tasks_dir, capsys):
    from lm_eval.api.task import ConfigurableTask

    quiet.quiet_lm_eval()
    config = yaml.safe_load((tasks_dir / "orchard_mc.yaml").read_text())
    task = ConfigurableTask(config=config)
    capsys.readouterr()
    task.build_all_requests(limit=2, rank=0, world_size=1)
    err = capsys.readouterr().err
    assert "orchard_mc contexts: 100%" in err, err
    assert len(task.instances) > 0


def test_orchards_bar_is_labelled_from_its_first_line(capsys):
    from driver.lm.progress import Progress

    bar = Progress(["w0@a"])
    bar.expect(4, 0, "loglikelihood")  # the bar's first line is drawn here, at 0%
    first = capsys.readouterr().err
    bar.advance(0, 4)
    bar.close()
    assert first.strip() and all(part.startswith("loglikelihood on 1 worker") for part in first.split("\r") if part.strip()), repr(first)
