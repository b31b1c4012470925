"""lm-evaluation-harness itself (`lm_eval`, the test extra) against `zlc serve`: its
`local-completions` model on a small local task (no download: the documents are written here),
one multiple-choice task (loglikelihood: `echo` + `logprobs` on token ids) and one generate_until
task. Oracle: each choice's loglikelihood equals the reference executor's log-softmax summed over
the continuation's tokens, tokenized the harness's own way (its `_encode_pair`), and each
generation equals the greedy reference text cut at the task's stop sequence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the 'test' extra")

MODEL = "llama-chat"
DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Hello", "choices": [" world", " there", "!"], "answer": 1},
]


def write_tasks(root: Path) -> Path:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{question}}\"\n")
    (root / "zlc_mc.yaml").write_text(
        "task: zlc_mc\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    (root / "zlc_gen.yaml").write_text(
        "task: zlc_gen\n" + common + "output_type: generate_until\ndoc_to_target: \" x\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


def test_lm_eval_local_completions_against_zlc_serve(server: Any, chat_bundle: Path, tmp_path: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    import zlc

    lm = LocalCompletionsAPI(model=MODEL, base_url=server.base_url + "/v1/completions",
                             tokenizer=str(chat_bundle.parent / "tokenizer"), tokenized_requests=True,
                             num_concurrent=1, max_retries=1, timeout=120)
    out = simple_evaluate(model=lm, tasks=["zlc_mc", "zlc_gen"], task_manager=TaskManager(
        include_path=str(write_tasks(tmp_path))), log_samples=True, limit=len(DOCS))
    assert out is not None
    bundle = zlc.load(chat_bundle)
    with bundle.session("reference") as s:
        def log_softmax(ids: list[int]) -> np.ndarray:
            s.reset()
            _, lg = s.prefill(ids, all_logits=True, want_logits=True)
            x = np.asarray(lg, dtype=np.float64)
            m = x.max(-1, keepdims=True)
            return np.asarray(x - m - np.log(np.exp(x - m).sum(-1, keepdims=True)))

        mc = out["samples"]["zlc_mc"]
        assert len(mc) == len(DOCS)
        for sample in mc:
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
                ctx, cont = lm._encode_pair(context, continuation)
                ref = log_softmax(ctx + cont)
                want = sum(ref[len(ctx) + i - 1, t] for i, t in enumerate(cont))
                greedy = all(int(np.argmax(ref[len(ctx) + i - 1])) == t for i, t in enumerate(cont))
                (got, is_greedy), = resp
                assert got == pytest.approx(want, abs=1e-3) and is_greedy == greedy
        gen = out["samples"]["zlc_gen"]
        assert len(gen) == len(DOCS)
        for sample in gen:
            prompt = bundle.tokenizer.encode(sample["arguments"][0][0])
            s.reset()
            toks = [t for t in s.stream(prompt, 6, eos=bundle.eos_token_ids) if t not in bundle.eos_token_ids]
            want = bundle.tokenizer.decode(toks).split("\n")[0]
            assert sample["resps"][0][0] == want
    assert "acc,none" in out["results"]["zlc_mc"]
