from moetrain.data.corpus import Document
from moetrain.data.tokenizer import EOS_TOKEN, eos_id, load_or_train_tokenizer, train_tokenizer

DOCS = [Document(f"d{i}", f"To be, or not to be, that is the question {i}. Whether 'tis nobler in the mind.\n" * 20)
        for i in range(10)]


def test_training_is_deterministic_and_respects_the_vocab_size():
    first = train_tokenizer(DOCS, 300)
    second = train_tokenizer(DOCS, 300)
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 300
    assert first.token_to_id(EOS_TOKEN) == eos_id(first) == 0


def test_byte_level_round_trip_of_unseen_text():
    tokenizer = train_tokenizer(DOCS, 300)
    text = "Ünïcode ☃ and tabs\tnever seen — still round-trips.\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_cache_is_keyed_by_corpus_and_vocab_size(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path))
    trained = load_or_train_tokenizer(DOCS, 300)
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.endswith("-v300.json")
    assert load_or_train_tokenizer(DOCS, 300).to_str() == trained.to_str()
    load_or_train_tokenizer(DOCS, 280)
    load_or_train_tokenizer(DOCS[:5], 300)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 3
