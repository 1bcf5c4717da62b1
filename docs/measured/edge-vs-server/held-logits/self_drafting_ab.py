"""A llama.cpp board's drafting with and without the logits a confidence stop keeps: the default
model's Q4_1 GGUF drafts its own continuation of the first 12 Spec-Bench questions, 96 tokens
each, in two-token proposals (a board's ahead chunk), llama.cpp on one thread. ``kept``: as the
drafter runs (the next proposal starts from the kept logits); ``refeed``: each proposal followed
by ``_settle()``, which gives the last position back so the next proposal feeds the last token
again (the behaviour before). Prints, per mode in the order given, the tokens drafted, the tokens
fed to llama.cpp (prompts included), the seconds, and whether the drafts equal the first mode's.

    taskset -c 1 python docs/measured/edge-vs-server/held-logits/self_drafting_ab.py \\
        refeed kept refeed kept refeed kept
"""

import json
import sys
import time

from transformers import AutoTokenizer

from edgespec.config import SamplingParams
from edgespec.drafters.llamacpp import LlamaCppDrafter
from edgespec.models.files import default_model_dir, default_model_gguf

QUESTIONS = "edgespec_cli/bench/spec_bench_questions.jsonl"  # run from the repository root


def main() -> None:
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    with open(QUESTIONS) as f:
        questions = [json.loads(line) for line in f][:12]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for q in questions]
    d = LlamaCppDrafter(str(default_model_gguf()), n_slots=2, n_threads=1, target_tokenizer=tok)
    fed = [0]
    feed_many = d.feed_many

    def counting(feeds):
        fed[0] += sum(len(feed) for _, feed in feeds)
        return feed_many(feeds)

    d.feed_many = counting
    first = None
    for mode in sys.argv[1:] or ["refeed", "kept"]:
        fed[0] = 0
        t0 = time.perf_counter()
        drafted = []
        for ids in prompts:
            s = d.open(list(ids), SamplingParams())
            got: list[int] = []
            while len(got) < 96:
                got += s.propose(2).tokens
                if mode == "refeed":
                    s._settle()
            drafted.append(got)
            s.close()
        first = drafted if first is None else first
        print(f"{mode}: drafted {sum(map(len, drafted))} tokens, fed {fed[0]}, "
              f"{time.perf_counter() - t0:.1f} s, drafts as the first mode's: {drafted == first}",
              flush=True)
    d.close()


if __name__ == "__main__":
    main()
