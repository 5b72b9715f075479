import pytest

from gbv.data import DATASETS, load_prompts

COUNTS = {"gsm8k": 1319, "humaneval": 164, "math500": 500}


def test_every_listed_dataset_loads():
    """DATASETS is the registry the benchmark reads: every name in it must have a loader (a name
    added without one fails here), and every loader must be listed."""
    from gbv import data

    assert set(DATASETS) == set(data._LOADERS)
    for name in DATASETS:
        assert load_prompts(name, limit=1)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_and_format(name):
    prompts = load_prompts(name)
    assert len(prompts) == COUNTS[name]
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    if name == "humaneval":
        assert all("def " in p for p in prompts)
    else:
        assert all(p.startswith("Question: ") and p.endswith("\nAnswer:") for p in prompts)
        assert all(len(p) > len("Question: \nAnswer:") for p in prompts)


def test_gsm8k_first_prompt():
    first = load_prompts("gsm8k", limit=1)[0]
    assert first.startswith("Question: Janet")


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_limit(name):
    assert load_prompts(name, limit=5) == load_prompts(name)[:5]
    assert len(load_prompts(name, limit=1)) == 1
    assert len(load_prompts(name, limit=10**6)) == COUNTS[name]


@pytest.mark.parametrize("limit", [0, -3])
def test_bad_limit(limit):
    with pytest.raises(ValueError, match="limit"):
        load_prompts("gsm8k", limit=limit)


def test_bad_name():
    with pytest.raises(ValueError) as exc:
        load_prompts("mbpp")
    msg = str(exc.value)
    assert "\n" not in msg
    for name in COUNTS:
        assert name in msg
