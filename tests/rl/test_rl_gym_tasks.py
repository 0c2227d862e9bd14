"""reasoning-gym as a source of tasks (``rg:<dataset>``): seeded problems, the dataset's own scorer."""

import pytest

from moetrain.errors import UserError
from moetrain.rl.tasks import get_task, problem_at
from moetrain.rl.tokenizer import ALPHABET
from refusals import refused

pytest.importorskip("reasoning_gym")


def test_problems_follow_the_seed_fit_the_alphabet_and_score_with_the_datasets_scorer():
    task = get_task("rg:chain_sum:min_terms=2,max_terms=3")
    problems = [problem_at(task, 0, "rl", i) for i in range(8)]
    assert [p.prompt for p in problems] == [problem_at(task, 0, "rl", i).prompt for i in range(8)]
    assert len({p.prompt for p in problems}) > 4
    for problem in problems:
        assert set(problem.prompt + problem.answer) <= set(ALPHABET)
        assert len(problem.prompt) <= task.max_prompt_chars and len(problem.answer) <= task.max_answer_chars
        # the sum, computed here from the prompt's own terms
        expression = problem.prompt.rsplit(":", 1)[-1].rstrip("= ").strip()
        assert int(problem.answer) == eval(expression)  # noqa: S307 (digits and + - only)
        assert task.score(problem, f" {problem.answer} ") == 1.0
        assert task.score(problem, str(int(problem.answer) + 1)) == 0.0


def test_unknown_dataset_and_bad_options_are_user_errors():
    with pytest.raises(UserError, match="unknown reasoning-gym dataset 'no_such'"):
        get_task("rg:no_such")
    with pytest.raises(UserError, match="rg:chain_sum:min_terms=9,max_terms=2"):
        get_task("rg:chain_sum:min_terms=9,max_terms=2")


def test_cli_refuses_an_unknown_dataset_in_one_line(capsys):
    refused(capsys, ["rl", "--task", "rg:no_such", "--steps", "1", "--quiet"], "unknown reasoning-gym dataset")
