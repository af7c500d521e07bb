"""Prompting baselines: `prompting: {NAME: TEXT}` in a sweep file adds a configuration `prompt:NAME` (op `prompt`,
no layer, no alpha, no steering) that puts TEXT before every prompt and task context: as the system message of the
model's chat template where it has one, else TEXT, a blank line, then the prompt.

Its requests have other tokens than the grid's, so they are not grid cells: its prompt-set requests run unsteered
in one dispatch per kind for every baseline (`answer`), and its lm-eval tasks in an lm-eval run of their own with
lm-eval's `system_instruction` (`task_plan`). It gets every row, sample and generation a configuration gets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from worker.spec import NO_STEERING

from driver.judge.schema import PROMPT
from driver.sweep.configs import Config
from driver.sweep.grid import run_grids

__all__ = ["PROMPT", "configs", "prefixed", "system_instruction", "task_plan", "answer"]


def configs(prompting: dict[str, str]) -> list[Config]:
    """A configuration per prompting baseline, in the file's order."""
    return [Config(f"{PROMPT}:{name}", NO_STEERING, op=PROMPT, text=text) for name, text in prompting.items()]


def prefixed(tokenizer, text: str, prompt: str) -> str:
    """`prompt` with `text` before it: the chat template's system message and user turn (a template that takes no
    system message: `text`, a blank line and `prompt` as the user turn), else `text`, a blank line, `prompt`."""
    if not getattr(tokenizer, "chat_template", None):
        return f"{text}\n\n{prompt}"
    chat = [{"role": "system", "content": text}, {"role": "user", "content": prompt}]
    try:
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    except Exception:  # jinja2's TemplateError: "System role not supported" (e.g. Gemma's)
        user = [{"role": "user", "content": f"{text}\n\n{prompt}"}]
        return tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)


def system_instruction(text: str, chat: bool) -> str:
    """lm-eval's `system_instruction` for `text`: the system message under the chat template; without one lm-eval
    joins it to the context with nothing between, so it gets the blank line here."""
    return text if chat else f"{text}\n\n"


def task_plan(plan, config: Config):
    """The sweep's lm-eval plan (driver.lm.evaluation.Plan) for a prompting baseline: its text as the system instruction."""
    return dataclasses.replace(plan, system_instruction=system_instruction(config.text, plan.apply_chat_template))


def answer(executor, prompted: Sequence[tuple[list, list]], answers: dict[str, list], failed: dict[int, str], task_counts: dict[str, int],
           first: int, echo: Callable[[str], None] = print) -> None:  # fmt: skip
    """Every prompting baseline's (target pairs, generation requests) in `prompted`, unsteered, in one dispatch per
    kind; each baseline's answers appended to `answers[kind]` as a steering configuration's are laid out: its
    lm-eval part (None: its lm-eval run is its own) then its prompt-set requests. A failure (non-finite scores)
    fails every baseline, configuration indices `first`, `first` + 1, ... in `failed`."""
    wanted = {"loglikelihood": [r for pairs, _ in prompted for r in pairs], "generate": [r for _, gens in prompted for r in gens]}
    echo(f"sweep: {len(prompted)} prompting baseline{'s' * (len(prompted) != 1)}: {len(wanted['loglikelihood'])} loglikelihood and "
         f"{len(wanted['generate'])} generate requests, unsteered")
    got, bad, _ = run_grids(executor, [NO_STEERING], wanted, lambda line: None)
    for kind, column in (("loglikelihood", 0), ("generate", 1)):
        if kind not in answers and not wanted[kind]:
            continue
        start = 0
        for mine in prompted:
            n = len(mine[column])
            theirs = got[kind][0][start : start + n] if kind in got else []
            answers.setdefault(kind, []).append([None] * task_counts.get(kind, 0) + list(theirs))
            start += n
    for q in range(len(prompted)) if bad else ():
        failed[first + q] = bad[0]
