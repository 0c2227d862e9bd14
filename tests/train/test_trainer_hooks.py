"""A run of another objective changes the loop only through the objects ``Trainer`` is given: a batch
source and one ``TrainerHooks``, called at the points and in the order ``moetrain.train.trainer`` states,
with what each point knows (as the RL hooks use them)."""

import io

from rich.console import Console

from moetrain.config import TrainingConfig, load_model_config
from moetrain.config.run import RunSpec
from moetrain.data.synthetic import SyntheticDataset
from moetrain.train import SuppliedParts, Trainer
from moetrain.train.trainer import TrainerHooks

TRAINING = TrainingConfig(steps=5, global_batch=4, micro_batch=2, seq_len=32, lr=3e-3, warmup_steps=2)
LOSS_FIELDS = ("loss", "lm_loss", "aux_loss", "lr", "grad_norm")


class RecordedSource:
    """A batch source of the caller's: the synthetic batches, keeping the steps they were asked for."""

    def __init__(self, vocab_size: int) -> None:
        self.inner = SyntheticDataset(vocab_size, TRAINING.seq_len, TRAINING.seed)
        self.steps: list[int] = []

    def step_batch(self, step, global_batch, micro_batch, dp_rank=0, dp_size=1):
        self.steps.append(step)
        return self.inner.step_batch(step, global_batch, micro_batch, dp_rank, dp_size)


class NotingHooks(TrainerHooks):
    """Notes a field from its batch and one from every second update; stops after three steps."""

    def next_batch(self, trainer, step):
        trainer.note(batch_step=step)
        return None  # the batch source's

    def after_step(self, trainer, step, batch):
        if step % 2 == 0:
            trainer.note(even_update=step)
        return {"updated_to": step}

    def finished(self, trainer) -> bool:
        return trainer.step >= 3


class RecordingHooks(TrainerHooks):
    """Every call, with the step it was told (or the trainer's, where the point has no step argument); it
    makes the batches itself, and checks that ``after_step`` is handed the batch it made for that step."""

    makes_batches = True

    def __init__(self, vocab_size: int) -> None:
        self.source = SyntheticDataset(vocab_size, TRAINING.seq_len, TRAINING.seed)
        self.calls: list[tuple[str, int]] = []
        self.made = None

    def attach(self, trainer):
        assert trainer.run is not None and trainer.data is None  # the layout is built; no corpus was read
        self.calls.append(("attach", trainer.step))

    def next_batch(self, trainer, step):
        self.calls.append(("next_batch", step))
        self.made = self.source.step_batch(step, TRAINING.global_batch, TRAINING.micro_batch)
        return self.made

    def after_step(self, trainer, step, batch):
        assert batch is self.made and step == trainer.step
        self.calls.append(("after_step", step))
        return {}

    def finished(self, trainer):
        self.calls.append(("finished", trainer.step))
        return False

    def saved(self, trainer, path):
        self.calls.append(("saved", int(path.name.removeprefix("step-"))))

    def loaded(self, trainer, path):
        self.calls.append(("loaded", trainer.step))

    def close(self, trainer):
        self.calls.append(("close", trainer.step))


def _spec(**run) -> RunSpec:
    return RunSpec(training=TRAINING, run={"device": "cpu", "cluster": "cpu", "quiet": True, **run})


def test_hooks_on_a_given_batch_source_train_its_batches_as_the_plain_loop():
    plain = Trainer(_spec(synthetic_data=True), SuppliedParts(console=Console(file=io.StringIO()))).train()
    source = RecordedSource(load_model_config(_spec().model).vocab_size)
    # no corpus is read when the batches are given: the data path is never opened
    hooked = Trainer(_spec(data="/nonexistent/corpus.jsonl"),
                     SuppliedParts(console=Console(file=io.StringIO()), batches=source, hooks=NotingHooks()))
    rows = hooked.train()
    assert source.steps == [0, 1, 2]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [{k: r[k] for k in LOSS_FIELDS} for r in rows] == [{k: r[k] for k in LOSS_FIELDS} for r in plain[:3]]
    assert [r["batch_step"] for r in rows] == [0, 1, 2] and [r["updated_to"] for r in rows] == [1, 2, 3]
    # a noted field belongs to its own step's row only
    assert [r.get("even_update") for r in rows] == [None, 2, None]


def test_the_hooks_are_called_at_their_points_in_the_stated_order(tmp_path):
    vocab = load_model_config(_spec().model).vocab_size
    run = {"data": "/nonexistent/corpus.jsonl", "save_dir": str(tmp_path / "ckpt")}
    first = RecordingHooks(vocab)
    Trainer(_spec(stop_at=2, **run), SuppliedParts(console=Console(file=io.StringIO()), hooks=first)).train()
    # finished is asked before each step and after it (where a True would save); step 2 is the last of
    # this run, so it saves without asking
    assert first.calls == [("attach", 0), ("finished", 0), ("next_batch", 0), ("after_step", 1),
                           ("finished", 1), ("finished", 1), ("next_batch", 1), ("after_step", 2),
                           ("saved", 2), ("close", 2)]
    resumed = RecordingHooks(vocab)
    Trainer(_spec(stop_at=3, resume=True, **run),
            SuppliedParts(console=Console(file=io.StringIO()), hooks=resumed)).train()
    assert resumed.calls == [("attach", 0), ("loaded", 2), ("finished", 2), ("next_batch", 2), ("after_step", 3),
                             ("saved", 3), ("close", 3)]
