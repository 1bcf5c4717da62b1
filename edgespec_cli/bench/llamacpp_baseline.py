"""llama.cpp's own decoding as benchmark baselines (needs the optional llamacpp extra).

``llamacpp_target_only``: plain greedy decoding of a GGUF by llama-cpp-python.
``llamacpp_prompt_lookup``: its prompt-lookup decoding (``LlamaPromptLookupDecoding`` as the
draft model), greedy. Both take and return token ids, stop after a stop token (kept, as
transformers' ``generate`` keeps it) or ``max_new_tokens``, and reuse one loaded model per
(file, method, threads) so a benchmark times decoding, not loading.
"""

from __future__ import annotations

from functools import lru_cache


N_CTX = 2048  # prompt + output tokens a baseline run may hold (edgespec: --max-context)


@lru_cache(maxsize=4)
def _load(gguf_path: str, prompt_lookup: bool, n_threads: int):
    from edgespec.drafters.llamacpp import import_llama_cpp, load_llama

    import_llama_cpp()
    draft = None
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
    # weights loaded as the llamacpp drafter loads them (load_llama: no extra buffer types)
    # prompt lookup verifies drafts from the logits of every fed position: llama-cpp-python
    # keeps them only with logits_all (without it, a prompt longer than its batch fails)
    return load_llama(gguf_path, n_ctx=N_CTX, n_threads=n_threads, n_threads_batch=n_threads,
                      draft_model=draft, logits_all=prompt_lookup)


def _greedy(llm, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    if len(prompt_ids) + max_new_tokens > N_CTX:
        raise ValueError(f"prompt + output ({len(prompt_ids) + max_new_tokens} tokens) exceeds "
                         f"the baseline's context of {N_CTX}")
    llm.reset()  # no reuse of an earlier run's cache: every run pays its prefill
    stop = set(stop_ids or ())
    out: list[int] = []
    for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if int(token) in stop or len(out) >= max_new_tokens:
            break
    return out


def llamacpp_target_only(gguf_path, prompt_ids: list[int], max_new_tokens: int, stop_ids,
                         n_threads: int | None = None) -> list[int]:
    """Greedy decoding of ``prompt_ids`` by llama.cpp alone; the new token ids."""
    import torch

    llm = _load(str(gguf_path), False, n_threads or torch.get_num_threads())
    return _greedy(llm, prompt_ids, max_new_tokens, stop_ids)


def llamacpp_prompt_lookup(gguf_path, prompt_ids: list[int], max_new_tokens: int, stop_ids,
                           n_threads: int | None = None) -> list[int]:
    """Greedy prompt-lookup decoding by llama-cpp-python (``LlamaPromptLookupDecoding`` drafts,
    the model verifies); the new token ids."""
    import torch

    llm = _load(str(gguf_path), True, n_threads or torch.get_num_threads())
    return _greedy(llm, prompt_ids, max_new_tokens, stop_ids)
